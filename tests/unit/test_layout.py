"""The package's layout: no import cycle, Lua and Redis commands only in ``store/``, a store that needs no side.

Pure Python: the sources are parsed, never imported. Every import counts:
at module level, inside functions (a lazy import hides a cycle, it does not
remove it) and under ``TYPE_CHECKING`` (mypy follows those).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "celery_dedup"
STORE = PACKAGE / "store"
#: Where every Lua script lives (package data, read by ``store/scripts.py``).
LUA = STORE / "lua"
#: Attributes that load or run a Lua script on a redis-py client, or reach the store's registered scripts.
SCRIPT_ATTRIBUTES = frozenset(
    {"register_script", "script_load", "eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "scripts"}
)
#: Names of redis-py's script class and of the store's loader.
SCRIPT_NAMES = frozenset({"Script", "load_script"})
#: redis-py client methods that send a command (names no other object of the package calls). ``get``, ``set``
#: ``delete``, ``exists`` and ``info`` are left out: dictionaries, paths and loggers have them too.
COMMAND_ATTRIBUTES = frozenset(
    {
        *("hget", "hset", "hgetall", "hmget", "hdel", "hincrby", "hlen", "hkeys", "hvals", "hexists"),
        *("zadd", "zrem", "zcard", "zscore", "zrange", "zrevrange", "zrangebyscore", "zrevrangebyscore"),
        *("zrangebylex", "zlexcount", "sadd", "srem", "smembers", "sismember", "scard", "sscan_iter"),
        *("lpush", "rpush", "lrange", "llen", "lrem", "pipeline", "transaction", "scan_iter", "config_get"),
        *("pexpire", "expire", "pttl", "ttl", "get_primaries", "memory_usage", "execute_command"),
    }
)
#: Where Redis may be spoken outside the store: the kombu transport's own channel (it is a broker).
COMMANDS_ALSO_IN = frozenset({PACKAGE / "transports" / "redis.py"})
#: Top-level modules both sides share, and the only ones the store may use: they import only each other.
SHARED = frozenset({"exceptions", "keys", "modes", "config", "policy", "decisions", "header", "payloads"})


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """``(module, line)`` for each module of the package that ``name`` imports, wherever the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                if f"{base}.{alias.name}" in known:  # a module: ``from . import runtime``
                    yield f"{base}.{alias.name}", node.lineno
                elif base in known:  # a name the module defines
                    yield base, node.lineno


def graph() -> dict[str, dict[str, int]]:
    """module -> the package's modules it imports -> the line of the first such import."""
    found = modules()
    known = set(found)
    edges: dict[str, dict[str, int]] = {}
    for name, path in found.items():
        targets = edges.setdefault(name, {})
        for target, line in imported(name, path, known):
            if target != name:
                targets.setdefault(target, line)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def describe(component: list[str], edges: dict[str, dict[str, int]]) -> str:
    inside = set(component)
    links = [
        f"  {source} -> {target} (line {line})"
        for source in component
        for target, line in sorted(edges[source].items())
        if target in inside
    ]
    return "\n".join([", ".join(component), *links])


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def script_uses(path: Path) -> Iterator[str]:
    """Where ``path`` loads, runs or names a Lua script (docstrings and comments may mention one)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip = docstrings(tree)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and node.attr in SCRIPT_ATTRIBUTES:
            yield f"line {line}: .{node.attr}"
        elif isinstance(node, ast.Name) and node.id in SCRIPT_NAMES:
            yield f"line {line}: {node.id}"
        elif isinstance(node, ast.ImportFrom):
            yield from (f"line {line}: imports {a.name}" for a in node.names if a.name in SCRIPT_NAMES)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in skip
            and (".lua" in node.value or "redis.call" in node.value)
        ):
            yield f"line {line}: {node.value!r}"


def test_the_graph_sees_every_kind_of_import() -> None:
    edges = graph()
    assert len(edges) > 20, sorted(edges)
    assert "celery_dedup.task" in edges["celery_dedup"], "a name from a module (from .task import DedupTask)"
    assert "celery_dedup.exceptions" in edges["celery_dedup.keys"], "a relative import"
    assert "celery_dedup.contrib.django.commit" in edges["celery_dedup.task"], "an import inside a function"
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_through_others() -> None:
    edges = graph()
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(describe(component, edges) for component in found)


def test_lua_is_loaded_and_run_only_in_the_store() -> None:
    found = {
        str(path.relative_to(PACKAGE.parent)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if STORE not in path.parents
        for uses in [list(script_uses(path))]
        if uses
    }
    assert not found, f"Lua scripts are the store's: {found}"
    scripts = sorted(PACKAGE.rglob("*.lua"))
    assert scripts, "no Lua script found"
    assert all(path.parent == LUA for path in scripts), [str(p) for p in scripts if p.parent != LUA]


def command_uses(path: Path) -> Iterator[str]:
    """Where ``path`` calls a redis-py method that sends a command."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COMMAND_ATTRIBUTES:
            yield f"line {node.lineno}: .{node.func.attr}()"


def test_redis_is_spoken_only_in_the_store() -> None:
    found = {
        str(path.relative_to(PACKAGE.parent)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if STORE not in path.parents and path not in COMMANDS_ALSO_IN
        for uses in [list(command_uses(path))]
        if uses
    }
    assert not found, f"Redis commands are the store's: {found}"
    assert list(command_uses(STORE / "store.py")), "the check finds no command even in the store"


def test_the_store_imports_no_side() -> None:
    store = f"{PACKAGE.name}.store"
    allowed = {f"{PACKAGE.name}.{name}" for name in SHARED}
    found = {
        source: sorted(target for target in targets if target not in allowed and not target.startswith(store + "."))
        for source, targets in graph().items()
        if source == store or source.startswith(store + ".")
    }
    assert any(name.startswith(store + ".") for name in found), "no store modules found"
    found = {source: targets for source, targets in found.items() if targets}
    assert not found, f"the store imports more than the shared modules: {found}"


def test_the_shared_modules_import_only_each_other() -> None:
    shared = {f"{PACKAGE.name}.{name}" for name in SHARED}
    edges = graph()
    assert shared <= set(edges), sorted(shared - set(edges))
    found = {source: sorted(set(edges[source]) - shared) for source in sorted(shared)}
    found = {source: targets for source, targets in found.items() if targets}
    assert not found, f"shared modules import a side: {found}"


def test_every_folder_of_modules_is_a_package() -> None:
    """A folder of modules without ``__init__.py`` imports from a checkout, but the wheel leaves it out."""
    folders = {path.parent for path in PACKAGE.rglob("*.py")}
    missing = sorted(
        str(folder.relative_to(PACKAGE.parent)) for folder in folders if not (folder / "__init__.py").exists()
    )
    assert not missing, f"folders of modules that are no package: {missing}"
