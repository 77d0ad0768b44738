"""The kvplug command line: plugins listing, config commands, exit codes and messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvplug.cli import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"


@pytest.fixture
def run(monkeypatch):
    for var in [v for v in os.environ if v.startswith("KVPLUG_")]:
        monkeypatch.delenv(var)
    runner = CliRunner()

    def invoke(*args, env=None):
        return runner.invoke(app, list(args), env=env)

    return invoke


def test_plugins_json_lists_builtins_and_the_example(run):
    result = run("plugins", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    plugins = {p["name"]: p for p in data["plugins"]}
    assert plugins["kvplug.plugins.allocators"]["provides"]["allocator"] == [
        "paged",
        "standard",
        "swa",
    ]
    assert plugins["kvplug.plugins.allocators"]["builtin"] is True
    assert plugins["example_policy"]["distribution"] == "kvplug-example-policy"
    assert plugins["example_policy"]["provides"]["eviction_policy"] == ["largest_first"]
    assert plugins["example_policy"]["hooks"] == ["kvplug_eviction_policies"]
    policies = {c["name"]: c for c in data["components"]["eviction_policy"]}
    assert policies["largest_first"]["plugin"] == "example_policy"
    assert policies["largest_first"]["options"]["properties"]["tie_break"]["default"] == "lru"
    assert data["failed"] == []


def test_plugins_table(run):
    result = run("plugins")
    assert result.exit_code == 0
    assert "example_policy" in result.stdout and "largest_first" in result.stdout
    assert "failed plugins" not in result.stdout


def test_empty_allow_list_hides_the_example(run):
    data = json.loads(run("plugins", "--json", env={"KVPLUG_PLUGINS": ""}).stdout)
    assert "example_policy" not in {p["name"] for p in data["plugins"]}
    assert {"name": "example_policy", "reason": "not in KVPLUG_PLUGINS"} in data["skipped"]


def test_broken_plugin_is_listed_as_failed_and_strict_mode_fails(run, plugin_site):
    result = run("plugins", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["failed"] == [
        {
            "name": "broken",
            "distribution": "kvplug-broken",
            "version": "0.0.1",
            "stage": "import of 'kvplug_broken_mod'",
            "error": "RuntimeError: this plugin is broken on purpose",
        }
    ]
    table = run("plugins")
    assert (
        table.exit_code == 0
        and "failed plugins" in table.stdout
        and "kvplug-broken 0.0.1" in table.stdout
    )
    strict = run("plugins", "--strict")
    assert strict.exit_code == 3
    assert (
        "error: plugin 'broken' (distribution kvplug-broken 0.0.1) failed at import"
        in strict.stderr
    )
    assert "Traceback" not in strict.stderr
    assert run("plugins", env={"KVPLUG_STRICT_PLUGINS": "1"}).exit_code == 3
    debug = run("plugins", "--strict", "--debug")
    assert debug.exit_code == 3 and "Traceback" in debug.stderr


def test_config_validate_and_show(run):
    result = run("config", "validate", str(EXAMPLES / "default.toml"))
    assert result.exit_code == 0
    assert "valid (allocator=standard, prefix_cache=radix, eviction_policy=lru)" in result.stdout
    shown = json.loads(run("config", "show", str(EXAMPLES / "example_policy.json")).stdout)
    assert shown["eviction_policy"] == {"name": "largest_first", "options": {"tie_break": "fifo"}}
    assert shown["pool"]["capacity_tokens"] == 8192 and shown["pool"]["page_size"] == 1


def test_every_bundled_config_validates(run):
    paths = sorted(str(p) for p in EXAMPLES.iterdir())
    result = run("config", "validate", *paths)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count(": valid (") == len(paths) == 5


def test_unknown_policy_exits_2_with_the_valid_names(run, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('eviction_policy = "lruu"\n')
    result = run("config", "validate", str(path))
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert line.startswith(
        "error: unknown eviction policy 'lruu'. Did you mean 'lru'? Valid eviction policies:"
    )
    assert "largest_first" in line and "slru" in line and "\n" not in line


def test_bad_options_and_bad_files_exit_2(run, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[eviction_policy]\nname = "largest_first"\noptions = { tie_break = "random" }\n'
    )
    result = run("config", "validate", str(path))
    assert result.exit_code == 2
    assert (
        "invalid config: eviction_policy.options.tie_break: Input should be 'lru' or 'fifo'"
        in result.stderr
    )
    assert run("config", "show", str(tmp_path / "nope.toml")).exit_code == 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"pool": {"page_size": 0}}')
    result = run("config", "validate", str(bad))
    assert (
        result.exit_code == 2 and "pool.page_size: Input should be greater than 0" in result.stderr
    )


def test_config_schema_is_the_models_json_schema(run):
    schema = json.loads(run("config", "schema").stdout)
    assert schema["title"] == "KVCacheConfig"
    assert set(schema["properties"]) == {
        "allocator",
        "prefix_cache",
        "eviction_policy",
        "pool",
        "storage",
        "block_hash",
        "kv_events",
        "metrics",
    }


def test_version(run):
    assert run("--version").stdout.strip() == "kvplug 0.1.0"


def test_installed_console_script_runs(plugin_site):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUG_")}
    env["PYTHONPATH"] = str(plugin_site)
    script = Path(sys.executable).with_name("kvplug")
    result = subprocess.run(
        [str(script), "plugins", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [f["name"] for f in data["failed"]] == ["broken"]
    assert {"example_policy", "extra"} <= {p["name"] for p in data["plugins"]}
    env["KVPLUG_STRICT_PLUGINS"] = "1"
    strict = subprocess.run(
        [str(script), "plugins"], capture_output=True, text=True, env=env, timeout=120
    )
    assert strict.returncode == 3 and strict.stderr.startswith("error: plugin 'broken'")


CLASHING_POLICY = """
from kvplug_hookspecs import EvictionPolicyRegistration, KeyedEvictionPolicy, hookimpl

class Mine(KeyedEvictionPolicy):
    def key(self, c):
        return c.last_access_time

@hookimpl
def kvplug_eviction_policies():
    yield EvictionPolicyRegistration(name="mine", factory=Mine, aliases=("lru",))
"""


def test_a_name_clash_exits_3_naming_both_providers(run, tmp_path, monkeypatch):
    from tests.conftest import write_distribution

    write_distribution(
        tmp_path,
        "kvplug-clash",
        "1.0",
        {"clash": "kvplug_clash_mod"},
        {"kvplug_clash_mod": CLASHING_POLICY},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run("plugins")
    assert result.exit_code == 3
    assert result.stderr.strip() == (
        "error: eviction policy 'lru' is provided by two plugins: 'kvplug.plugins.policies' "
        "(kvplug 0.1.0) and 'clash' (kvplug-clash 1.0); uninstall one or block it with "
        "KVPLUG_BLOCK_PLUGINS=clash"
    )
    assert run("plugins", env={"KVPLUG_BLOCK_PLUGINS": "clash"}).exit_code == 0
