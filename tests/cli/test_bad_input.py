"""Adversarial CLI input: every bad input is exit 2 and one line on stderr, and changes nothing.

Each case runs in an empty working directory holding only its config file; afterwards stdout is
empty, stderr is exactly one ``error: ...`` line naming the problem (no traceback, no rich box)
and the directory holds the same files with the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvplug.cli import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (``None`` for a directory)."""
    return {
        str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def run(monkeypatch, tmp_path):
    for var in [v for v in os.environ if v.startswith("KVPLUG_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def invoke(*args, env=None):
        return runner.invoke(app, list(args), env=env)

    return invoke


def assert_one_line_error(result, root: Path, before: dict[str, bytes | None], *fragments: str):
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert result.stdout == ""
    assert snapshot(root) == before


BAD_FILES = {
    "component-int": (
        "c.toml",
        "eviction_policy = 5\n",
        ["eviction_policy:", "expected a component name", "got int"],
    ),
    "component-list": (
        "c.toml",
        'allocator = ["paged"]\n',
        ["allocator:", "expected a component name", "got list"],
    ),
    "component-bool-json": (
        "c.json",
        '{"prefix_cache": true}',
        ["prefix_cache:", "got bool"],
    ),
    "component-table-without-name": (
        "c.toml",
        "[eviction_policy]\noptions = { protected_hits = 2 }\n",
        ["eviction_policy.name: Field required"],
    ),
    "component-name-not-a-string": (
        "c.toml",
        "[prefix_cache]\nname = 3\n",
        ["prefix_cache.name:", "valid string"],
    ),
    "pyproject-without-tool-kvplug": (
        "pyproject.toml",
        '[project]\nname = "x"\n',
        ["pyproject.toml' has no [tool.kvplug] table"],
    ),
    "pyproject-tool-not-a-table": (
        "pyproject.toml",
        "tool = 3\n",
        ["pyproject.toml' has no [tool.kvplug] table"],
    ),
    "pyproject-tool-kvplug-not-a-table": (
        "pyproject.toml",
        "[tool]\nkvplug = 3\n",
        ["pyproject.toml' must hold an object"],
    ),
    "invalid-toml": ("c.toml", "allocator = \n", ["c.toml' is not valid TOML"]),
    "invalid-json": ("c.json", "{", ["c.json' is not valid JSON"]),
    "json-array": ("c.json", "[1, 2]", ["must hold an object at the top level"]),
    "unsupported-suffix": ("c.yaml", "a: 1\n", ["unsupported suffix '.yaml'"]),
    "unknown-field": ("c.toml", 'allocatr = "paged"\n', ["allocatr: Extra inputs"]),
    "bad-pool-value": ("c.toml", "[pool]\ncapacity_tokens = -5\n", ["pool.capacity_tokens:"]),
}


@pytest.mark.parametrize("command", ["validate", "show"])
@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_config_file(run, tmp_path, case, command):
    name, text, fragments = BAD_FILES[case]
    (tmp_path / name).write_text(text)
    before = snapshot(tmp_path)
    assert_one_line_error(run("config", command, name), tmp_path, before, *fragments)


def test_not_utf8(run, tmp_path):
    (tmp_path / "c.toml").write_bytes(b"allocator = '\xff'\n")
    before = snapshot(tmp_path)
    result = run("config", "validate", "c.toml")
    assert_one_line_error(result, tmp_path, before, "c.toml' is not valid UTF-8")


def test_directory_is_reported_as_a_directory(run, tmp_path):
    (tmp_path / "configs.toml").mkdir()
    before = snapshot(tmp_path)
    for command in ("validate", "show"):
        result = run("config", command, "configs.toml")
        assert_one_line_error(result, tmp_path, before, "'configs.toml' is a directory")


def test_missing_file(run, tmp_path):
    before = snapshot(tmp_path)
    result = run("config", "validate", "nope.toml")
    assert_one_line_error(result, tmp_path, before, "'nope.toml' does not exist")


def test_unreadable_file(run, tmp_path, monkeypatch):
    (tmp_path / "c.toml").write_text('allocator = "paged"\n')
    before = snapshot(tmp_path)

    def deny(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", deny)  # chmod does not stop root
    result = run("config", "validate", "c.toml")
    monkeypatch.undo()
    assert_one_line_error(result, tmp_path, before, "'c.toml' cannot be read: Permission denied")


BAD_VARIABLES = {
    "KVPLUG_POOL_CAPACITY_TOKENS": ("abc", "pool.capacity_tokens: Input should be a valid integer"),
    "KVPLUG_POOL_PAGE_SIZE": ("0", "pool.page_size: Input should be greater than 0"),
    "KVPLUG_POOL_DEVICE": ("gpu", "unknown device 'gpu'"),
    "KVPLUG_POOL_STORE_KV": ("maybe", "pool.store_kv:"),
    "KVPLUG_POOL_BOGUS": ("1", "unknown variable KVPLUG_POOL_BOGUS"),
    "KVPLUG_EVICTION_POLICY": ("5", "expected a name or a JSON object"),
    "KVPLUG_ALLOCATOR": ('{"nam": "paged"}', "allocator.name: Field required"),
    "KVPLUG_PREFIX_CACHE": ("'Bad Name!'", "invalid component name"),
    "KVPLUG_ALLOCATOR_OPTIONS": ("3", "expected a JSON object"),
    "KVPLUG_STRICT_PLUGINS": ("maybe", "is not a boolean"),
    "KVPLUG_DISABLE_PLUGIN_AUTOLOAD": ("maybe", "is not a boolean"),
}


@pytest.mark.parametrize("var", sorted(BAD_VARIABLES))
def test_bad_variable_names_the_variable(run, tmp_path, var):
    value, fragment = BAD_VARIABLES[var]
    (tmp_path / "c.toml").write_text('eviction_policy = "lru"\n')
    before = snapshot(tmp_path)
    result = run("config", "validate", "c.toml", env={var: value})
    assert_one_line_error(result, tmp_path, before, var, fragment)


@pytest.mark.parametrize("var", ["KVPLUG_STRICT_PLUGINS", "KVPLUG_DISABLE_PLUGIN_AUTOLOAD"])
def test_bad_plugin_loading_boolean_in_plugins_command(run, tmp_path, var):
    before = snapshot(tmp_path)
    result = run("plugins", "--json", env={var: "perhaps"})
    assert_one_line_error(result, tmp_path, before, f"{var}='perhaps' is not a boolean")


USAGE_ERRORS = {
    "missing-argument": (["config", "validate"], "Missing argument"),
    "unknown-option": (["config", "validate", "--bogus", "c.toml"], "No such option: --bogus"),
    "unknown-command": (["nosuch"], "No such command 'nosuch'"),
    "unknown-subcommand": (["config", "nosuch"], "No such command 'nosuch'"),
    "extra-argument": (["config", "show", "c.toml", "d.toml"], "unexpected extra argument"),
    "bad-int": (["serve-example", "--prompts", "abc"], "Invalid value for '--prompts'"),
    "out-of-range": (["serve-example", "--prompts", "0"], "Invalid value for '--prompts'"),
    "option-without-value": (["serve-example", "--config"], "'--config' requires an argument"),
    "unknown-top-level-option": (["--bogus"], "No such option: --bogus"),
}


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_error_is_one_line(run, tmp_path, case):
    args, fragment = USAGE_ERRORS[case]
    (tmp_path / "c.toml").write_text('eviction_policy = "lru"\n')
    before = snapshot(tmp_path)
    result = run(*args)
    assert_one_line_error(result, tmp_path, before, fragment)
    assert "╭" not in result.stderr and "Usage:" not in result.stderr
    if case != "option-without-value":  # click raises that one without a context
        assert result.stderr.rstrip().endswith("--help')")


def test_help_still_works(run):
    for args in (["--help"], ["config", "--help"], ["config", "validate", "--help"]):
        result = run(*args)
        assert result.exit_code == 0, result.stderr
        assert "Usage" in result.stdout and result.stderr == ""
    assert "--strict" in run("config", "validate", "--help").stdout
    bare = run()  # no command: the help, as before
    assert bare.exit_code == 2 and "Usage" in bare.stdout


def test_serve_example_directory_config(run, tmp_path):
    (tmp_path / "conf").mkdir()
    before = snapshot(tmp_path)
    result = run("serve-example", "--config", "conf")
    assert_one_line_error(result, tmp_path, before, "'conf' is a directory")


# cuda:63 exists on no machine this runs on: without CUDA or with fewer devices it is a problem.
MISSING_DEVICE = "[pool]\ndevice = 'cuda:63'\n"


def test_unavailable_device_warns_and_stays_valid(run, tmp_path):
    (tmp_path / "c.toml").write_text(MISSING_DEVICE)
    before = snapshot(tmp_path)
    result = run("config", "validate", "c.toml")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("c.toml: valid (")
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: c.toml: device 'cuda:63' requested")
    assert snapshot(tmp_path) == before


def test_unavailable_device_fails_with_strict(run, tmp_path):
    (tmp_path / "c.toml").write_text(MISSING_DEVICE)
    before = snapshot(tmp_path)
    result = run("config", "validate", "--strict", "c.toml")
    assert_one_line_error(result, tmp_path, before, "c.toml: device 'cuda:63' requested")


def test_available_devices_do_not_warn(run):
    result = run("config", "validate", str(EXAMPLES / "example_policy.json"), "--strict")
    assert result.exit_code == 0 and result.stderr == ""
    auto = run("config", "validate", str(EXAMPLES / "default.toml"))
    assert auto.exit_code == 0 and auto.stderr == ""


RESOLVE_VARIABLES = {
    "unknown-name": (
        {"KVPLUG_EVICTION_POLICY": "lruu"},
        "unknown eviction policy 'lruu'",
        "(set by KVPLUG_EVICTION_POLICY='lruu')",
    ),
    "bad-plugin-option": (
        {
            "KVPLUG_EVICTION_POLICY": "slru",
            "KVPLUG_EVICTION_POLICY_OPTIONS": '{"protected_hits": "x"}',
        },
        "eviction_policy.options.protected_hits:",
        "(set by KVPLUG_EVICTION_POLICY_OPTIONS=",
    ),
    "bad-option-in-json-selection": (
        {"KVPLUG_ALLOCATOR": '{"name": "paged", "options": {"bogus": 1}}'},
        "allocator.options.bogus:",
        "(set by KVPLUG_ALLOCATOR=",
    ),
}


@pytest.mark.parametrize("case", sorted(RESOLVE_VARIABLES))
def test_a_resolution_error_names_the_variable(run, tmp_path, case):
    env, problem, variable = RESOLVE_VARIABLES[case]
    (tmp_path / "c.toml").write_text("[pool]\ndevice = 'cpu'\n")
    before = snapshot(tmp_path)
    result = run("config", "show", "c.toml", env=env)
    assert_one_line_error(result, tmp_path, before, problem, variable)


def test_an_option_from_the_file_is_not_blamed_on_a_name_variable(run, tmp_path):
    (tmp_path / "c.toml").write_text(
        '[eviction_policy]\nname = "slru"\noptions = { protected_hits = "x" }\n'
    )
    before = snapshot(tmp_path)
    result = run("config", "validate", "c.toml", env={"KVPLUG_EVICTION_POLICY": "slru"})
    assert_one_line_error(result, tmp_path, before, "eviction_policy.options.protected_hits:")
    assert "set by" not in result.stderr
