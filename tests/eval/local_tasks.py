"""Small lm-eval tasks defined by local YAML and JSONL files, one per kind of request: multiple
choice (loglikelihood), perplexity (loglikelihood_rolling) and generation with stop strings
(generate_until, stopping at "O", frequent in what the random test model writes, or a newline).
Nothing is downloaded: `dataset_path: json` reads the JSONL written here."""

from __future__ import annotations

import json
from pathlib import Path

MC = [
    {"question": "2 + 2 =", "choices": [" 4", " 5", " 22"], "answer": 0},
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "abc", "choices": ["d", "x", "yz"], "answer": 0},
    {"question": "def f(x):\n    return", "choices": [" x", " 1 +", "\n"], "answer": 0},
    {"question": "Paris is in", "choices": [" France", " Spain"], "answer": 0},
    {"question": "", "choices": ["hello", "world"], "answer": 1},
]
PPL = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "import os\nimport sys\n\ndef main(argv):\n    for name in argv[1:]:\n"
             "        print(os.path.basename(name))\n    return 0\n\n"
             "if __name__ == '__main__':\n    sys.exit(main(sys.argv))\n"},
    {"text": "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 4},
]
GEN = [
    {"prompt": "Q: What is 1 + 1?\nA:", "answer": " 2"},
    {"prompt": "def add(a, b):\n    return", "answer": " a + b"},
    {"prompt": "Once upon a time", "answer": " there"},
    {"prompt": "x = [1, 2, 3]\nprint(len(x))  #", "answer": " 3"},
]

YAML = {
    "tiny_mc": """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""",
    "tiny_ppl": """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "tiny_gen": """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["O", "\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}
ROWS = {"tiny_mc": MC, "tiny_ppl": PPL, "tiny_gen": GEN}


def write_local_tasks(directory: Path) -> Path:
    """The three tasks' YAML and JSONL files in `directory`; returns it (an lm-eval include path)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in YAML.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[name]))
        (directory / f"{name}.yaml").write_text(text.format(data=data))
    return directory
