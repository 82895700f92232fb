"""Which arguments after SCRIPT are elasticd's and which are the script's (`run` and `submit`).

elasticd's options may follow SCRIPT (`elasticd run train.py --devices 2`), so an argument after SCRIPT
named like one of them was taken as elasticd's even where the script declares an option of that name:
`elasticd run --workers 4 --devices 2 dcgan.py --workers 2` (pytorch/examples' DCGAN, whose `--workers`
is its DataLoader's) ran 2 logical workers instead of 4 and exited 0. Here such an argument goes to the
script, as torchrun would give it, with a note on stderr; so does everything after `--`.
"""

from __future__ import annotations

import ast

import click

_DECLARING = {"add_argument", "option"}   # argparse's parser.add_argument, click's @click.option


def declared_options(script: str) -> set[str]:
    """Option strings the script declares (`parser.add_argument("--workers", "-j")`, `click.option(...)`),
    read from its source; empty if it cannot be read or parsed (running it will say why)."""
    try:
        with open(script, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=script)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in _DECLARING:
            found.update(a.value for a in node.args
                         if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-"))
    return found


def split_target(target: str) -> tuple[str, str | None]:
    """SCRIPT[:FUNC] -> (script, func)."""
    script, sep, func = target.rpartition(":")
    if sep and script and func.isidentifier():
        return script, func
    return target, None


def _our_options(command: click.Command) -> dict[str, bool]:
    """Each of the command's option strings -> whether it takes a value."""
    takes: dict[str, bool] = {}
    for p in command.params:
        if isinstance(p, click.Option):
            for opt in (*p.opts, *p.secondary_opts):
                takes[opt] = not (p.is_flag or p.count)
    return takes


def route(command: click.Command, args: list[str], notes: list[str]) -> list[str]:
    """`args` reordered so that click gives the script what is the script's: elasticd's options first, then
    `--`, then the script's arguments in their order. Arguments before SCRIPT are left as they are."""
    ours = _our_options(command)
    i = 0
    while i < len(args):                       # find SCRIPT: the first argument that is no option's
        tok = args[i]
        if tok == "--" or not tok.startswith("-") or tok == "-":
            break
        if ours.get(tok, False):
            i += 1                             # its value
        i += 1
    if i >= len(args) or args[i] == "--":
        return args
    script, _ = split_target(args[i])
    declared = declared_options(script)
    mine: list[str] = []
    theirs: list[str] = []
    j = i + 1
    while j < len(args):
        tok = args[j]
        if tok == "--":
            theirs += args[j + 1:]
            break
        name = tok.split("=", 1)[0]
        if name in ours and name not in declared:
            mine.append(tok)
            if ours[name] and "=" not in tok and j + 1 < len(args):
                mine.append(args[j + 1])
                j += 1
        else:
            if name in ours:
                notes.append(f"elasticd: {name} after {script} is given to the script, which declares it; "
                             f"elasticd's own {name} goes before SCRIPT")
            theirs.append(tok)
        j += 1
    return [*args[:i + 1], *mine, *(["--", *theirs] if theirs else [])]


class ScriptCommand(click.Command):
    """A command of the form `[OPTIONS] SCRIPT[:FUNC] [ARGS]...` (see the module's docstring)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        notes: list[str] = []
        routed = route(self, list(args), notes)
        if not ctx.resilient_parsing:
            for note in dict.fromkeys(notes):
                click.echo(note, err=True)
        return super().parse_args(ctx, routed)
