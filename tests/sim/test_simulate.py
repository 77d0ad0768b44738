"""The simulator end to end: exact small cases, Belady as a bound, the full-eviction baseline,
preemption under pressure, and the CLI's outputs."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from kvplug.cli import app
from kvplug.sim import (
    BELADY,
    RunSpec,
    SimulationError,
    TraceSource,
    check_names,
    parse_capacity,
    run_one,
    trace_summary,
)
from kvplug.traces import SyntheticSpec
from tests.conftest import MOONCAKE_TRACE

needs_trace = pytest.mark.skipif(
    not MOONCAKE_TRACE.exists(), reason="the shared Mooncake trace is not beside the clone"
)


def _mooncake(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return TraceSource(kind="mooncake", path=str(path), block_size=4)


def test_two_requests_sharing_three_of_four_blocks(tmp_path):
    """Blocks of 4 tokens, pages of 4, room for 5 blocks: the second request's first three
    blocks (12 tokens) are cached, its fourth is new. 12 of 32 prompt tokens hit."""
    source = _mooncake(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [0, 1, 2, 3]},
            {"timestamp": 1, "input_length": 16, "output_length": 1, "hash_ids": [0, 1, 2, 4]},
        ],
    )
    result = run_one(RunSpec(source=source, capacity_tokens=20, page_size=4, debug=True))
    assert (result.prompt_tokens, result.hit_tokens, result.evicted_tokens) == (32, 12, 0)
    assert result.hit_rate == pytest.approx(12 / 32)


def test_lru_and_fifo_differ_by_a_known_amount(tmp_path):
    """Pages of 4, room for 5, prompts only; the last prompt token is always recomputed.

    A=[0,1] and B=[2,3] take 4 pages. A+[7] (9 tokens) hits A's 8 and caches nothing new, but
    refreshes A's access time. C=[4,5] is one page short: LRU cuts B's tail (B was used
    last at R1), FIFO cuts A's (A was created first). A+[8] then hits 8 tokens under LRU and 4
    under FIFO: 16 against 12 hit tokens in all.
    """
    records = [
        {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 1, "input_length": 8, "output_length": 1, "hash_ids": [2, 3]},
        {"timestamp": 2, "input_length": 9, "output_length": 1, "hash_ids": [0, 1, 7]},
        {"timestamp": 3, "input_length": 8, "output_length": 1, "hash_ids": [4, 5]},
        {"timestamp": 4, "input_length": 9, "output_length": 1, "hash_ids": [0, 1, 8]},
    ]
    source = _mooncake(tmp_path / "t.jsonl", records)
    runs = {
        policy: run_one(
            RunSpec(
                source=source, policy=policy, capacity_tokens=20, page_size=4,
                cache_output=False, debug=True,
            )
        )
        for policy in ("lru", "fifo")
    }  # fmt: skip
    assert {p: (r.prompt_tokens, r.hit_tokens) for p, r in runs.items()} == {
        "lru": (42, 16),
        "fifo": (42, 12),
    }


def test_preemption_under_a_tiny_capacity_checks_conservation_every_step():
    burst = SyntheticSpec(num_requests=40, conversations_per_s=1000.0, think_time_s=0.0)
    source = TraceSource(kind="synthetic", synthetic=burst)
    spec = RunSpec(source=source, capacity_tokens=4096, timing="trace", debug=True)
    result = run_one(spec)
    assert result.completed == 40 and result.aborted == 0
    assert result.preemptions > 0


def test_capacities_parse_tokens_and_percentages():
    assert parse_capacity("3M") == 3_000_000
    assert parse_capacity("512k") == 512_000
    assert parse_capacity("1.5G") == 1_500_000_000
    assert parse_capacity("10%", unique_tokens=88_432) == 8_843
    for bad in ("", "x", "-1", "0", "5%%"):
        with pytest.raises(SimulationError):
            parse_capacity(bad, unique_tokens=100)


def test_belady_refuses_token_traces_and_block_caches(tmp_path):
    path = tmp_path / "tok.jsonl"
    path.write_text(json.dumps({"token_ids": [1, 2, 3], "output_length": 1}) + "\n")
    with pytest.raises(SimulationError, match="block-structured"):
        run_one(RunSpec(source=TraceSource(kind="tokens", path=str(path)), policy=BELADY,
                        capacity_tokens=64))  # fmt: skip
    with pytest.raises(SimulationError, match="radix-family"):
        run_one(RunSpec(source=TraceSource(limit=5), policy=BELADY, capacity_tokens=4096,
                        config={"prefix_cache": "block_hash"}, page_size=16))  # fmt: skip


@needs_trace
@pytest.mark.parametrize("capacity", [200_000, 600_000])
def test_belady_bounds_every_online_policy_on_the_real_trace(capacity):
    source = TraceSource(kind="mooncake", path=str(MOONCAKE_TRACE), limit=150)
    rates = {
        policy: run_one(
            RunSpec(source=source, policy=policy, capacity_tokens=capacity, page_size=512)
        ).hit_rate
        for policy in ("lru", "lfu", "fifo", "slru", BELADY)
    }
    assert rates[BELADY] >= max(rates.values())
    assert rates[BELADY] > rates["lru"]


@needs_trace
def test_full_eviction_never_beats_exact_shortfall_on_the_real_trace():
    source = TraceSource(kind="mooncake", path=str(MOONCAKE_TRACE), limit=150)
    base = RunSpec(source=source, capacity_tokens=200_000, page_size=512)
    exact, full = run_one(base), run_one(base.model_copy(update={"eviction": "full"}))
    assert full.hit_rate <= exact.hit_rate
    assert full.evicted_tokens > exact.evicted_tokens
    assert exact.over_eviction == 0.0 and full.over_eviction > 0.0


def test_trace_summary_counts_unique_block_tokens(tmp_path):
    source = _mooncake(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [0, 1]},
            {"timestamp": 1, "input_length": 7, "output_length": 1, "hash_ids": [0, 1]},
        ],
    )
    summary = trace_summary(source)
    assert (summary.requests, summary.prompt_tokens, summary.unique_tokens) == (2, 13, 7)


def test_cli_writes_json_csv_and_a_plot(tmp_path):
    out = tmp_path / "r.json"
    args = [
        "simulate", "--limit", "60", "--policy", "lru,fifo", "--capacity", "5%,25%",
        "--jobs", "1", "--baseline", "full-eviction", "--json", str(out),
        "--csv", str(tmp_path / "r.csv"), "--plot", str(tmp_path / "r.png"),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert set(payload) == {"meta", "runs"}
    assert payload["meta"]["requests"] == 60 and payload["meta"]["trace"] == "synthetic:chat"
    runs = payload["runs"]
    assert [(r["policy"], r["eviction"]) for r in runs] == [
        ("lru", "shortfall"), ("fifo", "shortfall"), ("belady", "shortfall"),
        ("lru", "shortfall"), ("fifo", "shortfall"), ("belady", "shortfall"),
        ("lru", "full"), ("lru", "full"),
    ]  # fmt: skip
    assert set(runs[0]) >= {
        "hit_rate", "prefill_saved", "evicted_tokens", "shortfall_requested_tokens",
        "shortfall_freed_tokens", "over_eviction", "preemptions", "completed",
        "cache_us_per_request", "capacity_tokens",
    }  # fmt: skip
    assert all(r["requests"] == r["completed"] + r["aborted"] == 60 for r in runs)
    csv_lines = (tmp_path / "r.csv").read_text().splitlines()
    assert len(csv_lines) == 9 and csv_lines[0].startswith("trace,cache,policy,")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity", "lots"], "capacity 'lots'"),
        (["--policy", "lru,nope"], "unknown eviction policy 'nope'"),
        (["--timing", "later"], "--timing must be"),
        (["--synthetic", "nope"], "unknown synthetic preset"),
    ],
)
def test_cli_errors_are_one_line_with_exit_2(args, message):
    result = CliRunner().invoke(app, ["simulate", "--limit", "5", *args])
    assert result.exit_code == 2
    assert message in result.output and result.output.strip().count("\n") == 0


def test_cli_reports_a_malformed_trace_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}\n'
                    "{oops\n")  # fmt: skip
    result = CliRunner().invoke(app, ["simulate", "--trace", str(path)])
    assert result.exit_code == 2 and "bad.jsonl:2: not valid JSON" in result.output
    skipped = CliRunner().invoke(
        app, ["simulate", "--trace", str(path), "--skip-bad", "--capacity", "1K", "--jobs", "1"]
    )
    assert skipped.exit_code == 0 and "skipped 1 malformed line" in skipped.output


def test_the_configs_policy_keeps_its_options_and_other_policies_get_defaults():
    """``--config`` with ``slru`` and its options, ``--policy slru,lru``: slru runs with the
    config's options (they were dropped before), lru with its defaults (slru's would not fit)."""
    from kvplug.sim.replay import _stack_config

    config = {"eviction_policy": {"name": "slru", "options": {"protected_hits": 3}}}
    specs = {
        p: RunSpec(source=TraceSource(limit=5), policy=p, capacity_tokens=4096, config=config)
        for p in ("slru", "lru")
    }
    assert _stack_config(specs["slru"]).eviction_policy.options == {"protected_hits": 3}
    assert _stack_config(specs["lru"]).eviction_policy.name == "lru"
    assert _stack_config(specs["lru"]).eviction_policy.options == {}
    slru = run_one(specs["slru"])
    assert slru.completed == 5
    # an alias names the same policy: the config's "lifo" selection is kept for "filo"
    alias = {"eviction_policy": {"name": "lifo", "options": {}}}
    spec = specs["slru"].model_copy(update={"config": alias, "policy": "filo"})
    assert _stack_config(spec).eviction_policy.name == "lifo"


def test_the_configs_policy_options_are_checked_before_any_run(tmp_path):
    """Bad options of the config's own policy fail up front, even when it is not replayed."""
    config = {"eviction_policy": {"name": "slru", "options": {"protected_hits": -1}}}
    spec = RunSpec(source=TraceSource(limit=5), policy="lru", capacity_tokens=4096, config=config)
    with pytest.raises(ValidationError, match="protected_hits"):
        check_names(spec, ["lru", BELADY])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    args = ["simulate", "--config", str(path), "--policy", "lru", "--limit", "5"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "protected_hits" in result.output
