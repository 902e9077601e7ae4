"""Regular expressions that come in files (a checkpoint's or an adapter's config), matched in bounded time.

compressed-tensors' `ignore` / `targets` ("re:PATTERN") and PEFT's `rank_pattern` / `alpha_pattern`
keys are regular expressions written by whoever made the files. Python's `re` backtracks: a pattern
such as `(a+)+$` takes time exponential in the length of the name it is tried on, so one line of a
config.json could hang a load for hours. They are run by RE2 instead (the `google-re2` package,
Google's linear-time engine: no backtracking), whose matching time is linear in the name and whose
compiled program is bounded in memory (8 MiB by default). A pattern RE2 cannot run (backreferences,
lookarounds), cannot parse, or that is not a string is refused as a CheckpointError naming the file
and key, like any other bad value of a checkpoint's config. RE2's syntax is Python's for what these
configs use (`.*`, classes, alternation, `\\d`, groups, counted repetition); Python's `\\Z` is read
as RE2's `\\z` (the end of the text).

    where = "config.json: quantization_config.ignore[2]"
    pattern_matches(r".*\\.mlp\\.down_proj", "model.layers.0.mlp.down_proj", where)  # True
"""

from __future__ import annotations

from functools import lru_cache

from tessera.config.errors import CheckpointError

MAX_PATTERN_CHARS = 4096  # far above any real module pattern; a longer one is a broken or hostile config


def _python_to_re2(pattern: str) -> str:
    """Python's end-of-text escape `\\Z` spelled as RE2 spells it (`\\z`), the one spelling of what these
    configs use that differs."""
    out, i = [], 0
    while i < len(pattern):
        piece = pattern[i:i + 2] if pattern[i] == "\\" else pattern[i]
        out.append("\\z" if piece == "\\Z" else piece)
        i += len(piece)
    return "".join(out)


@lru_cache(maxsize=256)
def _compiled(pattern: str):
    import re2

    options = re2.Options()
    options.log_errors = False  # the error is raised (and named) here, not logged to stderr by RE2
    return re2.compile(_python_to_re2(pattern), options)


def file_pattern(pattern: object, where: str):
    """`pattern` (a regular expression from a file) compiled for linear-time matching (`.match`,
    `.fullmatch`, `.search` as in `re`); CheckpointError naming `where` (the file and key) when it
    is not a string, too long, or not an expression RE2 runs."""
    if not isinstance(pattern, str):
        raise CheckpointError(f"{where} must be a string (a regular expression), got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise CheckpointError(f"{where}: the regular expression is {len(pattern)} characters long; at most "
                              f"{MAX_PATTERN_CHARS} are read")
    try:
        import re2  # google-re2, a dependency of tessera (pyproject.toml)
    except ImportError as e:
        raise CheckpointError(f"{where}: a regular expression from a file needs the google-re2 package "
                              "(pip install google-re2, or reinstall tessera)") from e
    try:
        return _compiled(pattern)
    except (re2.error, UnicodeError) as e:  # a syntax RE2 refuses, a program past its memory bound
        reason = "not valid Unicode" if isinstance(e, UnicodeError) else e.args[0] if e.args else e
        reason = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
        raise CheckpointError(f"{where}: {pattern[:200]!r} is not a regular expression Tessera runs "
                              f"({reason[:200]}; backreferences and lookarounds are not supported)") from None


def pattern_matches(pattern: str, name: str, where: str) -> bool:
    """Whether `pattern` matches at the start of `name` (as Python's `re.match`), in linear time."""
    return file_pattern(pattern, where).match(name) is not None
