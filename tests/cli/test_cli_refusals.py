"""Refused input: one line, ``tensorpar <command>: error: <setting>: ...``, exit 2, before any rank starts.

Every refusal of a command, argparse's and the launching process's checks alike, goes through
:func:`tensorpar.usage.refuse`; these run ``tensorpar.cli.main`` in this process (nothing is launched: a rank
started by mistake would fail the test through the patched :func:`tensorpar.launch.run_ranks`).
"""
import pytest

from tensorpar.cli import main


def _refused(argv, capsys) -> str:
    """The one line ``main(argv)`` refuses ``argv`` with (exit status 2; argparse's errors exit through SystemExit)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    return err[:-1]


@pytest.fixture(autouse=True)
def no_ranks(monkeypatch):
    from tensorpar import launch

    def started(*a, **k):
        raise AssertionError("a rank was started for a refused input")
    monkeypatch.setattr(launch, "run_ranks", started)


@pytest.mark.parametrize("argv,setting", [
    # the launching process's checks (validate)
    (["generate", "--model", "/nonexistent/never-read", "--timeout", "0"], "--timeout"),
    (["serve", "--model", "/nonexistent/never-read", "--port", "70000"], "--port"),
    (["train", "--model", "tiny", "--data", "/nonexistent/never-read.txt", "--tp", "0"], "--tp"),
    (["verify", "--model", "tiny", "--tp", "2,x"], "--tp"),
    (["verify", "--model", "tiny", "--tp", "2", "--seq-len", "0"], "--seq-len"),      # 0 meant the default before
    (["train", "--model", "tiny", "--data", "/nonexistent/never-read.txt", "--micro-batches", "0"], "micro"),
    (["plan", "--model", "nope", "--gpus", "8", "--global-batch", "8", "--seq", "64"], "--model"),
    # argparse's
    (["generate", "--timeout", "soon"], "--timeout"),
    (["serve", "--prefix-caching", "maybe"], "--prefix-caching"),
    (["train", "--lr", "fast"], "--lr"),
    (["verify", "--frobnicate"], "--frobnicate"),
    (["plan", "--gpus", "eight"], "--gpus"),
])
def test_every_refusal_of_a_command_has_its_prefix(capsys, argv, setting):
    """One prefix for every refusal of a command (review: the launcher's checks printed ``tensorpar: error:``,
    argparse's ``tensorpar <command>: error:``)."""
    line = _refused(argv, capsys)
    assert line.startswith(f"tensorpar {argv[0]}: error: ") and setting in line, line


def test_a_top_level_refusal_has_no_command(capsys):
    assert _refused(["gen"], capsys).startswith("tensorpar: error: command: invalid choice 'gen'")


# ---------------------------------------------------------------- what a hostile user found (review, item 3)
# Each of these used to end in a traceback's one line with exit 1, a line that named no setting, a note before the
# refusal (two lines), or a refusal only after every rank had run.

from tests.decode.test_generate_cli import tiny_with_tokenizer  # noqa: E402,F401  (random llama + tokenizer)


@pytest.mark.parametrize("content,match", [
    (b"\xff\xfe\x00garbage", "plan file '{f}' does not parse: 'utf-8' codec can't decode"),   # was: no setting
    (b'{"entries": {"model.layers.*.mlp": "gated_mlp"}, "blocks": 5}',
     "plan file '{f}': 'blocks' must be the pattern of the transformer blocks"),              # was: TypeError, exit 1
    (None, "--plan-file '{f}': a folder, not a plan file"),                                   # was: "no such file"
])
def test_plan_file_that_cannot_be_read_is_named(tiny_with_tokenizer, tmp_path, capsys, content, match):  # noqa: F811
    f = tmp_path / "plan.json"
    if content is None:
        f.mkdir()
    else:
        f.write_bytes(content)
    line = _refused(["generate", "--model", tiny_with_tokenizer, "--plan-file", str(f), "--print-plan"], capsys)
    assert line.startswith("tensorpar generate: error: " + match.format(f=f)), line


@pytest.mark.parametrize("content", ["[1, 2]", '"a100"', "3"])
def test_device_file_that_is_not_an_object(tmp_path, capsys, content):
    """A JSON list, string or number: was AttributeError ('list' object has no attribute 'get'), exit 1."""
    f = tmp_path / "dev.json"
    f.write_text(content)
    line = _refused(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--seq", "2048",
                     "--device-file", str(f)], capsys)
    assert line.startswith(f"tensorpar plan: error: --device-file {f}: a JSON ") and "not an object" in line, line


@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_verify_json_that_cannot_be_written_is_refused_before_the_ranks(tmp_path, capsys, where):
    """--json in a folder that does not exist was found only after every layout had been verified (exit 1)."""
    path = tmp_path / "nope" / "report.json" if where == "missing-folder" else tmp_path
    line = _refused(["verify", "--model", "tiny", "--tp", "2", "--json", str(path)], capsys)
    assert line.startswith(f"tensorpar verify: error: --json {str(path)!r}: "), line


def test_note_of_accepted_input_is_not_printed_before_a_refusal(tiny_with_tokenizer, capsys):  # noqa: F811
    """--tp-comm int8 on one host is noted (accepted); with --deterministic the run is refused: the refusal alone
    (it was the note, then the error: two lines)."""
    line = _refused(["generate", "--model", tiny_with_tokenizer, "--tp", "2", "--tp-comm", "int8", "--deterministic"],
                    capsys)
    assert line.startswith("tensorpar generate: error: --deterministic: --tp-comm int8"), line


def test_plan_note_is_printed_when_accepted_and_held_when_refused(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--inter-node-bw", "5", "--global-batch", "8", "--top", "1"]
    assert _refused([*args, "--seq", "0"], capsys) == "tensorpar plan: error: --seq (0) must be >= 1"
    assert main([*args, "--seq", "64"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("tensorpar: note: --inter-node-bw 5: all 8 devices are on one node"), err


def test_gguf_of_an_unreadable_version_is_one_line(tmp_path, capsys, monkeypatch):
    """A file that starts with GGUF but whose version the reader cannot read: the conversion's progress bar and
    then transformers' error about the tokenizer (four lines); now the version, before the progress bar."""
    monkeypatch.setenv("TENSORPAR_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + b"\0" * 64)
    line = _refused(["generate", "--model", str(f)], capsys)
    assert line.startswith(f"tensorpar generate: error: {f}: GGUF version 1 (a damaged or unsupported file); "), line


def test_train_note_is_not_printed_before_a_refusal(tmp_path, capsys):
    """--sequence-parallel at --tp 1 is noted (it changes nothing); an --out that is a file is then refused: the
    refusal alone."""
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    line = _refused(["train", "--model", "tiny", "--data", str(text), "--tp", "1", "--sequence-parallel",
                     "--out", str(text)], capsys)
    assert line.startswith(f"tensorpar train: error: --out {str(text)!r} is a file, not a folder"), line


@pytest.mark.parametrize("command", ["generate", "serve", "verify"])
def test_tp_above_the_heads_names_the_flag(tiny_with_tokenizer, capsys, command):  # noqa: F811
    """The plan's rule (every rank needs a query head, tensorpar.layers.attention.tp_heads_error) named the degree
    ``tp_size``, the library's word; the launching process names the flag."""
    extra = {"serve": ["--port", "0"], "generate": ["--print-plan"], "verify": []}[command]
    line = _refused([command, "--model", tiny_with_tokenizer, "--tp", "16", *extra], capsys)
    assert line == (f"tensorpar {command}: error: --tp 16: exceeds the model's 9 attention heads (every rank needs at "
                    f"least one query head; use --tp <= 9)"), line


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_model_folder_without_tokenizer_is_named(tmp_path, capsys, command):
    """A model folder with weights and config but no tokenizer files: one line naming --model and what the folder
    needs (review: transformers' message, naming no setting and suggesting packages to install)."""
    import os

    from tests.decode.test_generate import make_model_folder
    folder = make_model_folder(tmp_path / "m", "llama")
    for name in os.listdir(folder):
        if "token" in name:
            os.remove(os.path.join(folder, name))
    capsys.readouterr()         # the folder writer's progress bar
    line = _refused([command, "--model", str(folder)], capsys)
    assert line.startswith(f"tensorpar {command}: error: --model ") and "tokenizer.json" in line, line
