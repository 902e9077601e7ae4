"""An input file that holds no document (empty, or blank lines / whitespace only) is refused naming
it where it enters: `tessera preprocess` (text, JSONL and SFT conversations), vision-language SFT
data at training start, calibration data; beside good files too, where it was left out silently
(or, an empty .txt, became a document of one end-of-document token). Nothing is written."""

import pytest

from tessera.cli import main
from tessera.config.errors import DataError
from tessera.data import index_paths, preprocess
from tessera.data.sft import preprocess_sft
from tessera.data.vision_sft import load_vision_sft
from tests.data.test_vision_sft import IMAGE_ID, PROCESSOR, SEQ, T

EMPTY = {"empty.txt": "", "spaces.txt": " \n\t\n", "empty.jsonl": "", "blank.jsonl": "\n  \n"}


@pytest.mark.parametrize("name", list(EMPTY))
def test_an_empty_file_beside_good_ones_is_refused_naming_it(tmp_path, tokenizer, name):
    (tmp_path / "good.txt").write_text("some text\n")
    (tmp_path / name).write_text(EMPTY[name])
    with pytest.raises(DataError, match=rf"{tmp_path / name}: no documents found: the file is empty"):
        preprocess([tmp_path / "good.txt", tmp_path / name], tmp_path / "out", tokenizer, show_progress=False)
    assert not index_paths(tmp_path / "out")[1].exists()


def test_a_file_of_blank_lines_in_line_mode_and_in_a_directory(tmp_path, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("one line\n")
    (corpus / "b.txt").write_text("\n\n")
    with pytest.raises(DataError, match=rf"{corpus / 'b.txt'}: no documents found"):
        preprocess([corpus], tmp_path / "out", tokenizer, text_mode="line", show_progress=False)
    (corpus / "b.txt").write_text("another\n")
    assert preprocess([corpus], tmp_path / "out", tokenizer, text_mode="line", show_progress=False).documents == 2


def test_sft_and_vision_sft_refuse_an_empty_file(tmp_path, tokenizer, write_jsonl):
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "hello"}]}])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=rf"{tmp_path / 'empty.jsonl'}: no documents found"):
        preprocess_sft([good, tmp_path / "empty.jsonl"], tmp_path / "out", tokenizer, show_progress=False)
    assert not index_paths(tmp_path / "out")[1].exists()
    with pytest.raises(DataError, match=rf"{tmp_path / 'empty.jsonl'}: no documents found"):
        load_vision_sft([good, tmp_path / "empty.jsonl"], tokenizer, PROCESSOR, IMAGE_ID, T, SEQ)


def test_the_cli_says_it_in_one_line(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert main(["preprocess", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "out")]) == 1  # a DataError
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # past the progress bar
    assert len(errors) == 1 and f"{tmp_path / 'empty.txt'}: no documents found" in errors[0], errors


def test_records_with_empty_texts_are_still_documents(tmp_path, tokenizer, write_jsonl):
    """A JSONL record whose text is empty is a document (its end-of-document token): only a file
    with no record at all is refused."""
    path = write_jsonl(tmp_path / "texts.jsonl", [{"text": ""}, {"text": "x"}])
    assert preprocess([path], tmp_path / "out", tokenizer, show_progress=False).documents == 2
