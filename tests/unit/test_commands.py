"""Each script's command states its ARGV once: the header, the locals and the Python fields agree.

Pure Python: the Lua sources are read, never run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_dedup.store.commands import BY_TYPE, SPECS, argv_prelude
from celery_dedup.store.scripts import load_script

LUA = Path(__file__).resolve().parents[2] / "celery_dedup" / "store" / "lua"
#: A header line naming one of KEYS or ARGV: ``-- ARGV[4]  hold_ms: ...``.
HEADER = re.compile(r"^-- (KEYS|ARGV)\[([^\]]+)\]\s+(\w+)(?::|$)", re.M)
SCRIPTS = sorted(path.stem for path in LUA.glob("*.lua") if path.stem != "lib")


def header(name: str) -> dict[str, list[tuple[str, str]]]:
    """``KEYS`` and ``ARGV`` -> ``(index, name)`` as the script's header comment lists them."""
    text = (LUA / f"{name}.lua").read_text(encoding="utf-8")
    found: dict[str, list[tuple[str, str]]] = {"KEYS": [], "ARGV": []}
    for kind, index, field in HEADER.findall(text):
        found[kind].append((index, field))
    return found


def code(name: str) -> str:
    """The script's own lines, comments and the text of string literals left out."""
    text = (LUA / f"{name}.lua").read_text(encoding="utf-8")
    return "\n".join(re.sub(r"--.*", "", re.sub(r"'[^']*'", "''", line)) for line in text.splitlines())


def test_every_script_has_a_command_and_every_command_a_script() -> None:
    assert sorted(SPECS) == SCRIPTS
    assert len(BY_TYPE) == len(SPECS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_header_names_the_command_fields_in_order(name: str) -> None:
    spec = SPECS[name]
    listed = header(name)
    assert [field for _, field in listed["ARGV"]] == [field for field, _ in spec.fields]
    assert [field for _, field in listed["KEYS"]] == list(spec.keys)
    # Numbered from 1, one each; only the last of ARGV may stand for the rest ("3..").
    indexes = [index for index, _ in listed["ARGV"]]
    expected = [str(i) for i in range(1, len(indexes) + 1)]
    if spec.rest:
        expected[-1] += ".."
    assert indexes == expected


@pytest.mark.parametrize("name", SCRIPTS)
def test_keys_locals_follow_the_declared_keys(name: str) -> None:
    """Where the script names its KEYS in one line, it uses the declared names in order."""
    unpacked = re.search(r"^local ([\w, ]+) =\s*(KEYS\[1\](?:,\s*KEYS\[\d+\])*)\s*$", code(name), re.M)
    if unpacked is None:
        return
    names = [n.strip() for n in unpacked.group(1).split(",")]
    assert names == list(SPECS[name].keys[: len(names)])


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_reads_argv_only_through_its_locals(name: str) -> None:
    body = code(name)
    assert "ARGV" not in body, "ARGV is unpacked by the prelude made from the command"
    unused = [field for field, _ in SPECS[name].fields if not re.search(rf"\b{field}\b", body)]
    assert not unused, f"fields the script never reads: {unused}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_loaded_script_starts_its_body_with_the_prelude(name: str) -> None:
    prelude = argv_prelude(name)
    body = (LUA / f"{name}.lua").read_text(encoding="utf-8")
    assert load_script(name).endswith(prelude + body)
    assert prelude.count("\n") == 1, "one line: the script's line numbers move by one"


def test_the_prelude_converts_as_the_field_types_say() -> None:
    assert argv_prelude("limit_release") == "local token, ran = ARGV[1], ARGV[2] == '1'\n"
    assert argv_prelude("renew") == (
        "local lock_ms, record_ms = tonumber(ARGV[1]), tonumber(ARGV[2])"
        " local tokens = {} for i = 3, #ARGV do tokens[#tokens + 1] = ARGV[i] end\n"
    )
    assert argv_prelude("lib") == ""
