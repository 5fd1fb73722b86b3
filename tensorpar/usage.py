"""The parser of every ``tensorpar`` command: ``--help`` with the defaults (:class:`HelpFormatter`) and usage errors
as one line naming the setting, its value and what would work (:class:`ArgumentParser`, :func:`usage_error`); and
:func:`refuse`, the one way a command refuses bad input (argparse's errors and the launching process's checks
alike): ``tensorpar <command>: error: <setting>: <what is wrong> (<what would work>)``, exit status 2."""
from __future__ import annotations

import argparse

#: The exit status of a refused input (argparse's, for every refusal of every command).
REFUSED = 2


def prog(command: str | None) -> str:
    """The name a command's lines start with: ``tensorpar <command>`` (``tensorpar`` for the top level)."""
    return f"tensorpar {command}" if command else "tensorpar"


def refuse(command: str | None, error: object) -> int:
    """Refuse bad input: print ``tensorpar <command>: error: <error>`` as one line on stderr (whitespace joined;
    under torchrun also into torch elastic's error file, :func:`tensorpar.rank_errors.report_error`) and return
    :data:`REFUSED` (2), the exit status. Every refusal of a command goes through here: argparse's usage errors
    (:meth:`ArgumentParser.error`) and the checks each command makes in the launching process before any rank starts
    (``ValueError`` / ``OSError`` from its ``validate``). ``command``: ``generate``, ``serve``, ... (``None``: the top
    level). An error inside a rank is not a refusal: ``tensorpar: error: ... (rank R)``, exit 1
    (:func:`tensorpar.launch.run_ranks`)."""
    from tensorpar.rank_errors import report_error

    report_error(str(error), prog=prog(command))
    return REFUSED


def note(args, text: str) -> None:
    """A note on input that is accepted (``tensorpar: note: ...``: a flag that changes nothing here, a value that
    looks like a unit slip), held on ``args`` while the command's checks run and printed on stderr once they pass
    (:func:`release_notes`): a refused input is its one line, with no note before it. Printed at once where nothing
    holds notes (``args`` of a call from Python, or after :func:`release_notes`)."""
    import sys

    held = getattr(args, "held_notes", None)
    if held is None:
        print(text, file=sys.stderr, flush=True)
    else:
        held.append(text)


def hold_notes(args) -> None:
    """Start holding :func:`note` s on ``args`` (:func:`tensorpar.cli.main`, before the command's checks)."""
    args.held_notes = []


def release_notes(args) -> None:
    """Print the notes held on ``args`` (in order, on stderr) and print later ones at once: called by a command
    once its checks have passed, before any rank starts (and by :func:`tensorpar.cli.main` for a command that
    was not refused)."""
    import sys

    for text in getattr(args, "held_notes", None) or ():
        print(text, file=sys.stderr, flush=True)
    args.held_notes = None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` lists each option's default; defaults of ``None``/``False`` (unset, off) are not printed."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser (every ``tensorpar`` command's: subparsers take the class of their parent) whose usage errors
    are one line on stderr, ``<prog>: error: <setting>: <what is wrong> (<what would work>); see <prog> -h``, exit 2
    as argparse's (:func:`usage_error`, printed by :func:`refuse`), instead of the usage block and the error. ``-h`` / ``--help`` are
    argparse's, unchanged."""

    def error(self, message: str):
        command = self.prog.partition(" ")[2] or None       # prog: "tensorpar" or "tensorpar <command>"
        raise SystemExit(refuse(command, f"{usage_error(self, message)}; see {self.prog} -h"))


def _what_works(action: argparse.Action) -> str:
    """What an option takes, in words: its choices, or its type (an integer, a number) or metavar, else its
    default as an example."""
    if action.choices is not None:
        return "choose from " + ", ".join(map(str, action.choices))
    kind = {int: "an integer", float: "a number"}.get(action.type)
    if kind is None and isinstance(action.metavar, str):
        kind = action.metavar
    if kind is None and action.option_strings:
        flag = action.option_strings[-1]
        if action.default in (None, False, argparse.SUPPRESS):
            return f"give a value after {flag}"
        return f"give a value, e.g. {flag} {action.default}"
    return f"give {kind or 'a value'}"


def usage_error(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's error ``message`` for ``parser`` as one line naming the setting, its value and what would work:
    ``argument --dtype: invalid choice: 'float64' (choose from 'float32', 'bfloat16')`` -> ``--dtype: invalid choice
    'float64' (choose from float32, bfloat16)``; ``invalid int value: 'x'`` -> ``invalid value 'x' (give an
    integer)``; ``unrecognized arguments: --max-new-tokns 4`` -> ``unknown option --max-new-tokns (did you mean
    --max-new-tokens?)`` (the closest option, :func:`difflib.get_close_matches`). A message of another form is kept,
    less argparse's ``argument`` prefix."""
    import difflib
    import re

    m = re.fullmatch(r"argument (\S+): (.*)", message, re.S)
    if m:
        name, why = m.groups()
        action = next((a for a in parser._actions if name in ("/".join(a.option_strings), a.dest, a.metavar)), None)
        if action is None:
            return f"{name}: {why}"
        flag = action.option_strings[-1] if action.option_strings else name
        bad = re.fullmatch(r"invalid (choice|\w+ value): (.+?)(?: \(choose from .*\))?", why, re.S)
        if bad:
            what = "choice" if bad.group(1) == "choice" else "value"
            return f"{flag}: invalid {what} {bad.group(2)} ({_what_works(action)})"
        if why.startswith("expected "):        # "expected one argument", "expected at least one argument", ...
            return f"{flag}: {why.replace('argument', 'value')} ({_what_works(action)})"
        return f"{flag}: {why.replace('argument ', '')}"
    if message.startswith("unrecognized arguments: "):
        token = message[len("unrecognized arguments: "):].split()[0]
        if not token.startswith("-"):
            return f"unexpected argument {token!r} (the settings are options: --name value)"
        name = token.split("=")[0]
        known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        return f"unknown option {name}" + (f" (did you mean {close[0]}?)" if close else "")
    if message.startswith("the following arguments are required: "):
        missing = message[len("the following arguments are required: "):]
        action = next((a for a in parser._actions if missing.split(",")[0] in (a.dest, a.metavar)), None)
        return f"missing {missing}" + (f" ({_what_works(action)})" if action is not None else "")
    return message
