"""The exercise's check (`hicache_lab.lab.teach.exercise`) rejects every wrong answer in teaching/mistakes/ with the
cause it names (the audit's kind of mistake, or what the run shows), and accepts two different right answers
on every world. Each wrong answer runs on the one world that shows its mistake (`check(worlds=...)`), so that
the suite stays quick; `python -m hicache_lab exercise` runs them all in turn (one wrong answer, SHELL, is
checked through it: the command's first world is the one that shows it)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hicache_lab.__main__ import main
from hicache_lab.lab.teach import exercise_cli
from hicache_lab.lab.teach.exercise import HINT_ON_REQUEST, WORLDS, check
from hicache_lab.lab.teach.exercise_cli import EXAMPLES, mistakes_table
from hicache_lab.lab.teach.mistakes import MISTAKES

ROOT = Path(__file__).resolve().parents[2]
TEACHING = ROOT / "teaching"
needs_teaching = pytest.mark.skipif(
    not TEACHING.is_dir(), reason="a student edition: teaching/ (the answers and wrong answers) is left out"
)
PP2, PP3, TP2, CP2, SLOW, L3 = WORLDS

# (slot, function in teaching/mistakes/SLOT.py, the world that shows it, the kind the audit names or None,
#  words the verdict must hold)
WRONG = [
    ("pp_sync", "two_stages_only", PP3, "no_receive", "stage 2 made no receive"),
    ("pp_sync", "all_reduce_max", PP2, "symmetric_across_stages", "against"),
    ("pp_sync", "broadcast_from_stage_0", PP2, "symmetric_across_stages", "dist.broadcast over the pipeline group"),
    ("pp_sync", "blocking_send", PP2, "blocking_send", "blocking dist.send"),
    ("pp_sync", "sends_data_itself", PP2, "send_aliases_data", "dist.isend(data, ...)"),
    ("pp_sync", "drops_the_handle", PP2, "lost_send_handle", "dropped the handle its isend returned"),
    ("pp_sync", "global_ranks", TP2, "wrong_rank_space", "names no rank of that group"),
    ("pp_sync", "world_group", TP2, "wrong_rank_space", "meaning stage 1, but there 1 is global rank 1"),
    ("pp_sync", "irecv_without_wait", PP2, "recv_not_waited", "irecv"),
    ("pp_sync", "receives_into_a_new_tensor", PP2, "recv_elsewhere", "into another tensor"),
    ("pp_sync", "upstream", PP2, "backwards", "StallError: no batch for"),
    ("pp_sync", "handshake", PP2, "backwards", "with yours, "),
    ("pp_sync", "forwards_before_receiving", PP3, "forwarded_before_receive", "stage 1 sent [0, 0] to stage 2"),
    ("pp_sync", "middle_stage_keeps_it", PP3, None, "a message no stage sent"),
    ("pp_sync", "calls_the_labs_own", PP2, "uses_the_lab_own", "calls_the_labs_own calls the lab's own _pp_sync"),
    ("writing_check", "calls_the_labs_own", PP2, "uses_the_lab_own", "the lab's own _consume_acks"),
    ("writing_check", "only_finished_here", PP2, "wrong_ack_count", "where every rank agreed on"),
    ("writing_check", "no_wait", PP2, "copy_not_waited", "the oracle found"),
    ("writing_check", "newest_first", PP2, "acks_out_of_order", "of its queue"),
    ("writing_check", "keeps_the_lock", PP2, "lock_leaked", "write-through lock was not released"),
    ("writing_check", "releases_twice", PP2, "lock_released_twice", "lock"),
    ("writing_check", "forgets_to_publish", PP2, "node_not_published", "never published the node"),
    ("writing_check", "leaves_them_in_flight", PP2, "node_left_in_flight", "in ongoing_write_through"),
    ("writing_check", "unlocks_every_write", PP2, "wrong_node_taken", "whose acks it did not consume"),
    ("attn_groups", "attention_tp_only", CP2, "missing_group", "left out its attention-CP group"),
    ("attn_groups", "with_the_pipeline", CP2, "group_spans_stages", "in this run"),
    ("attn_groups", "the_ranks_not_the_groups", PP2, "not_groups", "must return a list of process groups"),
]


# Checked through the shell command instead (test_the_shell_command_works_from_the_repository_root): its first
# world is the one that shows this answer's mistake, so the command makes the same run, and one run serves both.
SHELL = "drops_the_handle"
IN_PROCESS = [w for w in WRONG if w[1] != SHELL]


def assert_two_levels(verdict, kind: str) -> None:
    """The kind and why it is wrong at once; the fix only on request (the verdict shown again with the hint)."""
    first = str(verdict)
    assert MISTAKES[kind].why in first, "the verdict says why, in the table's words"
    assert MISTAKES[kind].fix not in first and "hint=True" in first, "the fix is given only on request"
    verdict.show_hint = True
    assert first.replace(f"({HINT_ON_REQUEST})", f"hint: {MISTAKES[kind].fix}") == str(verdict)


@needs_teaching
@pytest.mark.spawns
@pytest.mark.parametrize(("slot", "name", "world", "kind", "words"), IN_PROCESS, ids=[w[1] for w in IN_PROCESS])
def test_a_wrong_answer_is_rejected_with_its_cause(tmp_path, slot, name, world, kind, words):
    verdict = check(**{slot: f"{TEACHING / 'mistakes' / slot}.py:{name}"}, out_dir=tmp_path, worlds=(world,))
    assert not verdict.ok, str(verdict)
    assert verdict.mistake == kind, str(verdict)
    assert words in str(verdict), str(verdict)
    if kind is not None:
        assert_two_levels(verdict, kind)
    if name == "handshake":  # a receive from a later stage is judged as one, not as a relay's receive elsewhere
        assert "into another tensor" not in str(verdict) and "against the lab's one-way relay" in str(verdict)
    if kind == "blocking_send":  # gloo's send runs through isend: not the student's, so no clone to advise
        assert "dist.isend(data" not in str(verdict) and "clone" not in str(verdict), str(verdict)
        assert "against the lab's one-way relay" in str(verdict), "the run goes on, and is measured"


@needs_teaching
def test_the_catalogue_covers_every_kind_of_mistake_the_audit_names():
    named = {kind for *_, kind, _ in WRONG if kind}
    assert named == set(MISTAKES), "a kind with no wrong answer here is a rule no test breaks"
    for kind, example in EXAMPLES.items():
        assert (example.partition(".py:")[0], example.partition(":")[2], kind) in {(w[0], w[1], w[3]) for w in WRONG}


def test_the_docs_table_lists_every_kind_and_only_the_teachers_one_the_fixes():
    docs = (ROOT / "docs" / "notebooks.md").read_text()
    for kind in MISTAKES:
        assert f"`{kind}`" in docs, f"docs/notebooks.md does not list {kind}"
    assert mistakes_table() in docs, "docs/notebooks.md's table is `python -m hicache_lab exercise --table`"
    assert not [m.fix for m in MISTAKES.values() if m.fix in docs], "a fix in the students' docs"
    if TEACHING.is_dir():
        teachers = (TEACHING / "README.md").read_text()
        assert mistakes_table(hint=True) in teachers, "teaching/README.md's is `exercise --table --hint`"


def test_a_student_edition_refuses_the_teachers_table(monkeypatch, capsys):
    """Without teaching/ (a student edition) `--table --hint` would print every fix and point at files the
    edition does not have; `--table` alone still prints the students' table. The teachers' checkout prints
    theirs, with the fixes."""
    if TEACHING.is_dir():
        assert main(["exercise", "--table", "--hint"]) == 0
        assert mistakes_table(hint=True) in capsys.readouterr().out
    monkeypatch.setattr(exercise_cli, "student_edition", lambda: True)
    assert main(["exercise", "--table", "--hint"]) == 2
    assert "--table --hint is the teachers' table" in capsys.readouterr().err
    assert main(["exercise", "--table"]) == 0 and mistakes_table() in capsys.readouterr().out


@needs_teaching
@pytest.mark.spawns
def test_the_solutions_pass_every_world(tmp_path):
    solutions = TEACHING / "solutions"
    verdict = check(
        pp_sync=f"{solutions / 'pp_sync.py'}:pp_sync",
        writing_check=f"{solutions / 'writing_check.py'}:writing_check",
        attn_groups=f"{solutions / 'attn_groups.py'}:attn_groups",
        out_dir=tmp_path,
    )
    assert verdict.ok, str(verdict)
    assert len(verdict.lines) == len(WORLDS) + 1


OTHER_ANSWERS = textwrap.dedent(
    """
    import torch.distributed as dist

    from hicache_lab.lab.teach.exercise import HINT_ON_REQUEST, WORLDS, check


    def star(self, data):
        # stage 0 sends to every later stage itself; each later stage receives from stage 0
        group = self.groups.pp_cache_group
        if self.pp_rank == 0:
            for stage in range(1, self.pp_size):
                self.work_list.append(dist.isend(data.clone(), group_dst=stage, group=group, tag=2))
        else:
            dist.recv(data, group_src=0, group=group, tag=2)


    def waits_for_the_last_only(self, count):
        # one copy stream finishes in order: once the last of them has finished, so have the ones before it
        acks = [self.controller.ack_write_queue.pop(0) for _ in range(count)]
        if acks:
            acks[-1].finish_event.synchronize()
        for ack in acks:
            for node_id in ack.node_ids:
                node = self.ongoing_write_through.pop(node_id)
                self.dec_lock_ref(node)
                self.publish_write(node)


    def every_attention_group(self):
        return [self.groups.attn_tp_group, self.groups.attn_cp_group]  # size-1 groups agree with themselves


    answers = {"pp_sync": star, "writing_check": waits_for_the_last_only, "attn_groups": every_attention_group}
    print(check(**answers, out_dir=OUT, worlds=(WORLDS[1], WORLDS[3])))
    """
)


@pytest.mark.spawns
def test_other_right_answers_pass_from_a_script_without_a_main_guard(tmp_path):
    """Functions given as themselves, from a script that calls check() at its top level: the ranks import it,
    and the check must neither run again there nor blame the functions. On the worlds where these answers part
    from the solutions' (3 stages for the star; a size-1 group kept beside the CP group), to keep the suite
    quick."""
    script = tmp_path / "my_answers.py"
    script.write_text(OTHER_ANSWERS.replace("OUT", repr(str(tmp_path / "runs"))))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.rstrip().endswith("PASSED"), result.stdout[-3000:]
    assert re.findall(r"^(.*): ok$", result.stdout, re.M) == [world.name for world in (PP3, CP2)]
    assert "sent 2 messages in one call (to stages [1, 2]), where in the chain" in result.stdout, "the star's note"


@pytest.mark.spawns
def test_the_stubs_fail_with_what_to_write(tmp_path):
    stub = tmp_path / "stub.py"
    stub.write_text('def pp_sync(self, data):\n    raise NotImplementedError("write pp_sync: relay data down")\n')
    verdict = check(pp_sync=f"{stub}:pp_sync", out_dir=tmp_path / "runs", worlds=(PP2,))
    assert not verdict.ok
    assert "not written yet: write pp_sync: relay data down" in str(verdict)


@needs_teaching
@pytest.mark.spawns
def test_the_shell_command_works_from_the_repository_root(tmp_path):
    """`python -m hicache_lab exercise --hint` on the wrong answer SHELL, every world in turn: the first shows its
    mistake and stops the check, so this is that answer's run, and its verdict is checked as the in-process ones
    are, with the hint the flag asks for."""
    slot, name, world, kind, words = next(w for w in WRONG if w[1] == SHELL)
    assert world == WORLDS[0] and MISTAKES[kind].fatal, "the command's first world must show it, and stop there"
    cmd = [sys.executable, "-m", "hicache_lab", "exercise", "--hint", f"--{slot.replace('_', '-')}"]
    cmd += [f"teaching/mistakes/{slot}.py:{name}", "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("FAILED"), result.stdout
    assert f"{world.name}: WRONG ({kind})" in result.stdout, result.stdout
    assert words in result.stdout and MISTAKES[kind].why in result.stdout, result.stdout
    assert f"hint: {MISTAKES[kind].fix}" in result.stdout, result.stdout


NOTEBOOKS = sorted((ROOT / "notebooks").glob("0*.ipynb"))
ANSWERS = ("isend(data.clone()", "group_src=self.pp_rank - 1", "dec_lock_ref(node)")  # in an answer's code only


def test_notebook_06_ships_stubs_and_no_notebook_shows_an_answer():
    """Each of 06's %%writefile cells is a stub that raises, its checks' committed outputs say what to write, and
    no notebook's code or output holds the lab's relay or writing_check (the exercise's answers)."""
    import nbformat

    exercise = nbformat.read(ROOT / "notebooks" / "06_exercises.ipynb", as_version=4)
    stubs = [c.source for c in exercise.cells if c.cell_type == "code" and c.source.startswith("%%writefile")]
    assert len(stubs) == 3 and all("raise NotImplementedError" in stub for stub in stubs)
    outputs = [o.get("text", "") for c in exercise.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert sum("not written yet" in text for text in outputs) >= 3, "the committed check outputs name the stubs"
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in (c for c in nb.cells if c.cell_type == "code"):
            shown = cell.source + "".join(str(o.get("text", "")) + str(o.get("data", "")) for o in cell.outputs)
            assert not [a for a in ANSWERS if a in shown], f"{path.name} shows an answer: {cell.source[:80]}"


def test_the_labs_own_function_is_no_answer_and_is_judged_before_any_world(tmp_path):
    """Given as the answer, the lab's own relay (or the design question's star) does the exercise's work: the
    check says so from the source, before any world runs (the two wrong answers of WRONG call the lab's own)."""
    for spec in ("hicache_lab.distributed.cache_sync:CacheSync._pp_sync", "hicache_lab.lab.teach.questions:star"):
        verdict = check(pp_sync=spec, out_dir=tmp_path)
        assert not verdict.ok and verdict.mistake == "uses_the_lab_own", str(verdict)
        assert "is the lab's own (hicache_lab/" in str(verdict) and not any(tmp_path.iterdir())
