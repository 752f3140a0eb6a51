"""Workloads as data (workload_files.py): length distributions, conversation files, and a run's requests.jsonl
replayed to the same run."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from hicache_lab.config import CacheConfig, RunConfig, WorkloadConfig
from hicache_lab.entrypoints.launch import run_world
from hicache_lab.errors import ConfigError
from hicache_lab.managers.workload import ConversationWorkload, MultiTurnWorkload, make_workload
from hicache_lab.workload_files import parse_length_dist, read_conversations, text_tokens

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = str(ROOT / "data" / "conversations_sample.json")


def write(path: Path, value) -> str:
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return str(path)


@pytest.mark.parametrize(
    "spec",
    ["uniform:3:9", "lognormal:20:60", "zipf:1.5:40", "poisson:5:12", "constant"],
)
def test_each_distribution_draws_from_the_seed_within_1_to_its_max(spec):
    dist = parse_length_dist(spec, "--output-length-dist", 7)
    drawn = dist.draw(np.random.default_rng(3), (400,))
    assert drawn.min() >= 1 and drawn.max() <= dist.most
    assert (drawn == dist.draw(np.random.default_rng(3), (400,))).all()
    assert len(set(drawn.tolist())) > (1 if spec != "constant" else 0)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("normal:3:9", "write constant or uniform:MIN:MAX"),
        ("uniform:9", "write constant or uniform:MIN:MAX"),
        ("uniform:a:9", "e.g. uniform:64:256"),
        ("uniform:10:9", "MIN must be an integer in 1..MAX"),
        ("uniform:1.5:9", "MIN must be an integer"),
        ("zipf:1:9", "ALPHA must be > 1"),
        ("lognormal:nan:9", "write constant"),
        ("poisson:5:0", "MAX an integer >= 1"),
        ("constant:5", "write constant"),
    ],
)
def test_a_bad_distribution_says_what_to_write(spec, message):
    with pytest.raises(ConfigError, match=f"--request-length-dist '{spec}': .*{message.replace('.', '[.]')}"):
        WorkloadConfig(request_length_dist=spec)


def test_distributions_keep_the_default_workload_and_the_pools_hold_every_max():
    plain, drawn = WorkloadConfig(), WorkloadConfig(request_length_dist="uniform:8:300", output_length_dist="zipf:2:40")
    default = MultiTurnWorkload(plain, 256)  # its tokens as before distributions existed
    digest = hashlib.sha256(json.dumps([default.openings, default.questions]).encode()).hexdigest()
    assert digest.startswith("f1a55d858c6e") and {n for row in default.answers for n in row} == {plain.output_length}
    a, b = MultiTurnWorkload(drawn, 256), MultiTurnWorkload(drawn, 256)  # every rank draws the same
    assert a.openings == b.openings and a.answers == b.answers and len({len(o) for o in a.openings}) > 1
    assert drawn.longest_sequence() == 300 + 7 * (40 + 32) + 40  # each at its MAX
    with pytest.raises(ConfigError, match="cannot hold one request of the workload"):
        RunConfig(workload=drawn, cache=CacheConfig(max_total_tokens=800))


def test_the_sample_is_what_its_script_writes_and_shares_its_system_prompts():
    spec = importlib.util.spec_from_file_location("conversations_sample", ROOT / "data" / "conversations_sample.py")
    spec.loader.exec_module(script := importlib.util.module_from_spec(spec))
    assert script.text() == Path(SAMPLE).read_text()
    workload = make_workload(WorkloadConfig(conversation_file=SAMPLE, num_rounds=4), 256)
    first = [req.prompt for req in workload.round_requests(0)]
    system = len(read_conversations(SAMPLE)[0].system.encode())
    assert first[0][:system] == first[1][:system] != first[4][:system]  # 4 clients per system prompt
    assert len(first) == 16 and len(workload.round_requests(3)) == 4  # of 2, 3, 4 and 2 turns


def test_a_turn_is_the_history_plus_its_human_text_and_answers_are_capped(tmp_path):
    turns = [
        {"from": "human", "value": "héllo"},
        {"from": "gpt", "value": "a" * 40},
        {"from": "human", "value": "again"},
    ]
    records = [{"system": "sys ", "conversations": turns}]
    cfg = WorkloadConfig(conversation_file=write(tmp_path / "c.json", records), num_clients=1, output_length=16)
    workload = ConversationWorkload(cfg, 100)
    (first,) = workload.round_requests(0)
    assert first.prompt == text_tokens("sys héllo", 100) and first.max_new_tokens == 16  # UTF-8 bytes mod 100
    first.output = list(range(16))
    workload.answered(first)
    second = workload.next_turn(first)
    assert second.prompt == first.prompt + first.output + text_tokens("again", 100) and second.max_new_tokens == 16
    assert workload.next_turn(second) is None
    assert cfg.longest_sequence() == 10 + 16 + 5 + 16  # a last human turn answers --output-length


@pytest.mark.parametrize(
    "value, message",
    [
        ("[1,", r"not JSON \(Expecting value at line 1\); the file needs one JSON value"),
        ({"conversations": []}, "needs a non-empty JSON list of records"),
        ([{"id": "x", "conversations": []}], r"\[0\] \(id 'x'\): needs a non-empty 'conversations' list"),
        ([{"conversations": [{"from": "human"}]}], r"\[0\], turn 0: needs a 'value' string"),
        ([{"conversations": [{"from": "gpt", "value": "hi"}]}], "turn 0: 'from' is 'gpt' where 'human' is due"),
        ([{"conversations": [{"from": "human", "value": ""}]}], "turn 0: an empty human turn"),
        ([{"conversations": [{"from": "system", "value": "s"}]}], r"\[0\]: holds no human turn"),
        ([{"system": 3, "conversations": [{"from": "human", "value": "q"}]}], "'system' a string"),
    ],
)
def test_a_bad_conversation_file_names_the_record_and_the_field(tmp_path, value, message):
    with pytest.raises(ConfigError, match=message):
        WorkloadConfig(conversation_file=write(tmp_path / "bad.json", value), num_clients=1)


def test_a_conversation_file_must_hold_the_clients_and_its_longest_turn_must_fit(tmp_path):
    with pytest.raises(ConfigError, match="holds 16 conversations, fewer than --num-clients 17: give --num-clients 16"):
        WorkloadConfig(conversation_file=SAMPLE, num_clients=17)
    with pytest.raises(
        ConfigError,
        match=r"sample.json \[14\]: its request holds 401 tokens .*: raise it, or lower --num-rounds",
    ):
        RunConfig(workload=WorkloadConfig(conversation_file=SAMPLE), cache=CacheConfig(max_total_tokens=400))
    with pytest.raises(ConfigError, match="--requests-file .*: give one workload file"):
        WorkloadConfig(conversation_file=SAMPLE, requests_file=SAMPLE)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"round": 0, "client": 0, "prompt": [1]}, ":1: 'rid' must be an integer >= 0, got None"),
        ({"rid": 0, "round": 0, "client": 0, "prompt": []}, "'prompt' must be a non-empty list of token ids"),
        ({"rid": 0, "round": 0, "client": 0, "prompt": [1], "output": []}, "'max_new_tokens' .* at least 1, got 0"),
        ({"rid": 0, "round": 0, "client": -1, "prompt": [1]}, "'client' must be an integer >= 0, got -1"),
    ],
)
def test_a_bad_requests_file_names_the_line_and_the_field(tmp_path, row, message):
    with pytest.raises(ConfigError, match=message):
        WorkloadConfig(requests_file=write(tmp_path / "r.jsonl", json.dumps(row) + "\n"))


def test_a_requests_file_is_checked_against_the_run_that_replays_it(tmp_path):
    row = {"rid": 0, "round": 3, "client": 0, "prompt": [1, 300], "max_new_tokens": 2, "ignore_eos": True}
    path = write(tmp_path / "r.jsonl", "\n".join(json.dumps(r) for r in (row, row)))
    with pytest.raises(ConfigError, match=":2: rid 0 again \\(line 1\\)"):
        WorkloadConfig(requests_file=path)
    path = write(tmp_path / "r.jsonl", json.dumps(row))
    with pytest.raises(ConfigError, match="holds round 3: give --num-rounds 4"):
        WorkloadConfig(requests_file=path, num_rounds=3)
    with pytest.raises(ConfigError, match=":1: token 300 is past --vocab-size 256"):
        RunConfig(workload=WorkloadConfig(requests_file=path))


@pytest.mark.parametrize("barrier", [True, False])
def test_a_runs_requests_replayed_give_the_run_again(small_config, tmp_path, barrier):
    cfg = small_config(check_outputs=False, enable_hierarchical_cache=True)
    cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, round_barrier=barrier))
    first = run_world(cfg, tmp_path / "run", verbose=False)
    written = tmp_path / "run" / "requests.jsonl"
    again = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, requests_file=str(written)))
    second = run_world(again, tmp_path / "replay", verbose=False)
    columns = ("round", "prompt_tokens", "cached_device", "cached_host", "hit_rate", "upper_bound_hit_rate")
    assert [[row[k] for k in columns] for row in second["rounds"]] == [[r[k] for k in columns] for r in first["rounds"]]
    assert (tmp_path / "replay" / "requests.jsonl").read_text() == written.read_text()  # prompts, outputs, order
    assert sum(row["cached_host"] for row in first["rounds"]) > 0  # the host tier took part
