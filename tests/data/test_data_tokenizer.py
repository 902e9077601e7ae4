import json
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tessera.config.errors import DataError
from tessera.data import DEFAULT_TOKENIZER_DIR, Tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "hello world, this is a test",
    "  leading spaces and\ttabs\nnew lines\r\n",
    "naïve café ünïcode 日本語 ✓",
    "<s>special</s> tokens <pad> inside text",
    "",
]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello, world"}]


def train_tiny_backend() -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return backend


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A LLaMA-like tokenizer (BOS added by its post-processor) saved by transformers."""
    backend = train_tiny_backend()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                              pad_token="<pad>")
    hf.chat_template = TEMPLATE
    directory = tmp_path_factory.mktemp("hf_tok")
    hf.save_pretrained(directory)
    return directory


def assert_same_as_transformers(ours: Tokenizer, directory: Path) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (theirs.bos_token_id, theirs.eos_token_id,
                                                       theirs.pad_token_id)
    assert ours.vocab_size == len(theirs)
    if ours.has_chat_template:
        for prompt in (False, True):
            assert ours.apply_chat_template(MESSAGES, add_generation_prompt=prompt) == \
                theirs.apply_chat_template(MESSAGES, add_generation_prompt=prompt, tokenize=False)


def test_tokenizer_saved_by_transformers_encodes_identically(hf_dir):
    ours = Tokenizer.from_path(hf_dir)
    assert ours.has_chat_template and ours.bos_token == "<s>"
    assert ours.encode("hello")[0] == ours.bos_id  # the post-processor's BOS
    assert_same_as_transformers(ours, hf_dir)


def test_loading_from_the_tokenizer_json_file_reads_the_configs_beside_it(hf_dir):
    ours = Tokenizer.from_path(hf_dir / "tokenizer.json")
    assert ours.eos_token == "</s>" and ours.has_chat_template
    assert ours.encode(TEXTS[0]) == Tokenizer.from_path(hf_dir).encode(TEXTS[0])


def test_config_flags_do_not_override_tokenizer_json(hf_dir, tmp_path):
    """As in transformers 5, add_bos_token / add_eos_token leave the post-processor as saved."""
    for name in ("tokenizer.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config.update(add_bos_token=False, add_eos_token=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_path(tmp_path)
    ids = ours.encode("hello world")
    assert ids[0] == ours.bos_id and ids[-1] != ours.eos_id
    assert_same_as_transformers(ours, tmp_path)


def test_older_config_layout(tmp_path):
    """Special tokens as AddedToken objects, a named template list, special_tokens_map.json."""
    train_tiny_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "</s>", "lstrip": False, "rstrip": False, "special": True},
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<pad>", "eos_token": "<s>"}))
    ours = Tokenizer.from_path(tmp_path)
    assert ours.eos_token == "</s>" and ours.pad_token == "<pad>" and ours.bos_token is None
    assert ours.chat_template == TEMPLATE
    assert ours.apply_chat_template(MESSAGES[:1]) == "[user] hi there</s>"


def test_missing_and_invalid_files_raise_data_error(tmp_path):
    with pytest.raises(DataError, match="tokenizer.json: tokenizer file is missing"):
        Tokenizer.from_path(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        Tokenizer.from_path(tmp_path)
    train_tiny_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="expected a JSON object"):
        Tokenizer.from_path(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(DataError, match="has no chat template"):
        Tokenizer.from_path(tmp_path).apply_chat_template(MESSAGES)


def test_save_round_trip(hf_dir, tmp_path):
    ours = Tokenizer.from_path(hf_dir)
    ours.save(tmp_path)
    again = Tokenizer.from_path(tmp_path)
    assert again.fingerprint == ours.fingerprint
    assert [again.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    assert_same_as_transformers(again, tmp_path)


def test_shipped_tokenizer(tokenizer):
    assert load_tokenizer().fingerprint == tokenizer.fingerprint == load_tokenizer("default").fingerprint
    assert tokenizer.vocab_size == 4096
    assert (tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id) == (0, 1, None)
    assert tokenizer.token_to_id("<|assistant|>") is not None
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json/decoder.py", "textwrap.py", "this.py"):
        source = (stdlib / name).read_text(encoding="utf-8")
        ids = tokenizer.encode(source)
        assert tokenizer.decode(ids) == source
        assert max(ids) < tokenizer.vocab_size and tokenizer.eos_id not in ids
    source = (stdlib / "textwrap.py").read_text(encoding="utf-8")
    assert len(source.encode()) / len(tokenizer.encode(source)) > 2.5  # it learned real merges
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert rendered == "<|user|>\nhi there<|end|>\n<|assistant|>\nhello, world<|end|>\n"
    assert tokenizer.encode("<|user|>")[0] == tokenizer.token_to_id("<|user|>")
    with pytest.raises(DataError, match="role must be system, user or assistant"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    assert_same_as_transformers(tokenizer, DEFAULT_TOKENIZER_DIR)


def test_special_token_missing_from_vocabulary_is_added_like_transformers(tmp_path):
    train_tiny_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>", "bos_token": "<s>"}))
    ours = Tokenizer.from_path(tmp_path)
    assert ours.eos_id == 320 and ours.vocab_size == 321
    assert ours.encode("a<|eot|>")[-1] == ours.eos_id
    assert_same_as_transformers(ours, tmp_path)
