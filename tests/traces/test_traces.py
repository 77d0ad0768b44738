"""Trace readers: block tokens, Mooncake and token JSONL parsing, malformed lines, synthetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplug.traces import (
    PRESETS,
    BlockPrompt,
    SyntheticSpec,
    TraceError,
    TraceRequest,
    block_id_of,
    block_tokens,
    read_mooncake,
    read_token_jsonl,
    synthetic_trace,
)
from tests.conftest import MOONCAKE_TRACE as MOONCAKE


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_equal_block_ids_give_equal_tokens_and_ids_never_collide():
    assert block_tokens(0, 4) == [1, 2, 3, 4]
    assert block_tokens(7, 4) == [29, 30, 31, 32]
    assert block_tokens(7, 4, 2) == [29, 30]
    assert {block_id_of(t, 4) for t in block_tokens(7, 4)} == {7}
    prompt = BlockPrompt([3, 9], 6, 4)
    assert list(prompt) == [13, 14, 15, 16, 37, 38]
    assert (prompt[4], prompt[-1], prompt[:5]) == (37, 38, (13, 14, 15, 16, 37))
    with pytest.raises(IndexError):
        prompt[6]


def test_mooncake_lines_become_block_prompts(tmp_path):
    path = _write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [0, 1]},
            {"timestamp": 3000, "input_length": 4, "output_length": 0, "hash_ids": [0]},
        ],
    )
    first, second = read_mooncake(path, block_size=4)
    assert list(first.prompt) == [1, 2, 3, 4, 5]
    assert (first.output_length, first.block_ids) == (2, (0, 1))
    assert list(second.prompt) == [1, 2, 3, 4] and second.output_length == 1
    assert (second.index, second.timestamp_ms) == (1, 3000.0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [0]}', "missing 'input_length'"),
        ('{"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": []}', ">= 1"),
        ('{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [0]}', "contradict"),
        ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [0]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_malformed_mooncake_lines_name_the_file_and_line(tmp_path, line, message):
    good = '{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}'
    path = _write(tmp_path / "bad.jsonl", [good, line])
    with pytest.raises(TraceError, match=rf"bad\.jsonl:2: .*{message}"):
        list(read_mooncake(path, block_size=4))
    skipped: list[str] = []
    assert len(list(read_mooncake(path, block_size=4, skip_bad=True, skipped=skipped))) == 1
    assert len(skipped) == 1 and skipped[0].startswith(f"{path}:2:")


def test_non_monotonic_timestamps_are_an_error(tmp_path):
    path = _write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 10, "input_length": 1, "output_length": 1, "hash_ids": [0]},
            {"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1]},
        ],
    )
    with pytest.raises(TraceError, match=r"t\.jsonl:2: timestamp 5 is before"):
        list(read_mooncake(path, block_size=4))


def test_token_jsonl(tmp_path):
    path = _write(
        tmp_path / "tok.jsonl",
        [
            {"token_ids": [5, 6, 7], "output_length": 2, "extra_key": "lora-a"},
            {"token_ids": [5, 6], "output_length": 1, "timestamp": 12.5},
            {"token_ids": [5, "x"], "output_length": 1},
            {"token_ids": [], "output_length": 1},
            {"token_ids": [1], "output_length": 0},
        ],
    )
    with pytest.raises(TraceError, match=r"tok\.jsonl:3: token_ids\[1\] = 'x'"):
        list(read_token_jsonl(path))
    skipped: list[str] = []
    first, second = read_token_jsonl(path, skip_bad=True, skipped=skipped)
    assert (list(first.prompt), first.extra_key, first.output_length) == ([5, 6, 7], "lora-a", 2)
    assert second.timestamp_ms == 12.5 and len(skipped) == 3


def test_synthetic_is_deterministic_under_a_seed_and_sessions_reuse_answers():
    spec = SyntheticSpec(num_requests=120, seed=7)
    a, b = list(synthetic_trace(spec)), list(synthetic_trace(spec))
    assert [(r.timestamp_ms, r.block_ids, r.output_length) for r in a] == [
        (r.timestamp_ms, r.block_ids, r.output_length) for r in b
    ]
    other = list(synthetic_trace(spec.model_copy(update={"seed": 8})))
    assert [r.block_ids for r in other] != [r.block_ids for r in a]
    assert [r.timestamp_ms for r in a] == sorted(r.timestamp_ms for r in a)
    # a later turn's prompt starts with an earlier turn's prompt followed by its answer
    turns = {r.block_ids: r for r in a}
    continued = 0
    for r in a:
        assert r.output is not None and len(r.output) == r.output_length
        history = (*r.block_ids, *r.output.block_ids)  # type: ignore[union-attr]
        continued += any(other.block_ids[: len(history)] == history for other in turns.values())
    assert continued > 10


def test_every_preset_generates():
    for name, spec in PRESETS.items():
        trace = list(synthetic_trace(spec.model_copy(update={"num_requests": 30})))
        assert len(trace) == 30, name


@pytest.mark.skipif(
    not MOONCAKE.exists(), reason="the shared Mooncake trace is not beside the clone"
)
def test_the_shared_mooncake_trace_reads_whole():
    trace = list(read_mooncake(MOONCAKE))
    assert len(trace) == 12031
    assert sum(len(r.prompt) for r in trace) == 144_793_823
    assert all(r.block_ids and r.block_ids[0] == 0 for r in trace)  # the shared system prompt


def _shape(name: str, n: int = 600) -> list[TraceRequest]:
    return list(synthetic_trace(PRESETS[name].model_copy(update={"num_requests": n})))


@pytest.mark.parametrize("name", ["tool-loop", "shared-system", "doc-bursts", "tree-search"])
def test_shaped_presets_are_seeded_ordered_and_exact(name):
    trace = _shape(name)
    assert len(trace) == 600
    assert [r.index for r in trace] == list(range(600))
    times = [r.timestamp_ms for r in trace]
    assert times == sorted(times)
    assert [r.block_ids for r in _shape(name)] == [r.block_ids for r in trace]
    other = synthetic_trace(PRESETS[name].model_copy(update={"num_requests": 600, "seed": 1}))
    assert [r.block_ids for r in other] != [r.block_ids for r in trace]
    for r in trace:
        assert len(r.prompt) == len(r.block_ids) * 16
        assert r.output is not None and r.output_length == len(r.output) > 0


def test_shared_system_puts_one_system_prompt_before_everything():
    trace = _shape("shared-system")
    system = tuple(range(32))
    assert all(r.block_ids[:32] == system for r in trace)
    histories = [(*r.block_ids, *r.output.block_ids) for r in trace[:200]]  # type: ignore[union-attr]
    later = {o.block_ids for o in trace}
    # a next turn re-sends the previous prompt and its answer; one-offs and last turns do not
    continued = sum(any(p[: len(h)] == h for p in later) for h in histories)
    assert 20 < continued < 150


def test_tool_loops_share_long_contexts_and_fork_sub_agents():
    trace = _shape("tool-loop")
    contexts = {r.block_ids[:128] for r in trace}
    assert len(contexts) == 6  # six shared contexts of 128 blocks
    prompts = {r.block_ids for r in trace}
    # a sub-agent's first prompt extends a main loop's history that a later step also extends
    forks = sum(
        1 for p in prompts if sum(1 for q in prompts if len(q) > len(p) and q[: len(p)] == p) >= 2
    )
    assert forks > 10


def test_doc_bursts_reread_a_document_in_bursts():
    trace = _shape("doc-bursts")
    header = trace[0].block_ids[:2]
    assert all(r.block_ids[:2] == header for r in trace)
    # most requests read a document that was read less than 30 s before (its burst)
    again = 0
    for i, r in enumerate(trace):
        doc = r.block_ids[:12]
        again += any(
            o.block_ids[:12] == doc and r.timestamp_ms - o.timestamp_ms < 30_000
            for o in trace[max(0, i - 60) : i]
        )
    assert again > 400
