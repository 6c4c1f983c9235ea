"""Runs that survive: `verity train` killed (driver SIGKILL between steps and mid-save, a worker SIGKILL
mid-step, SIGTERM) and resumed gives exactly the metrics of an uninterrupted run; export round trip.

Each run is a real `verity train` process on the tiny model (2 Ray workers, FSDP2 over gloo), with a
dense reward (the share of digits in the response) so that every step changes the weights: a resume
that lost any state (optimizer moments, LR schedule, sampler position, RNG) would drift.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.dense_reward import write_digit_reward

pytestmark = pytest.mark.slow

STEPS = 4
RUN_TIMEOUT_S = 400


def run_args(paths: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [
        f"model.path={paths['model']}",
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['test']}]",
        "data.train_batch_size=8",
        "data.max_prompt_length=32",
        "data.max_response_length=6",
        "data.val_max_samples=16",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=8",
        "actor.optim.lr=1e-3",
        "algorithm.kl.use_kl_loss=true",
        f"reward.custom_path={paths['reward']}",
        f"trainer.total_steps={STEPS}",
        "trainer.n_workers=2",
        "trainer.cpus_per_worker=0.5",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        *extra,
    ]


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "verity.cli.main", "train", *args]


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERITY_DEBUG_")}
    env.update(extra)
    return env


def train(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(args), env=environment(**env), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


def wait_for(predicate, timeout_s: float, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run exited ({process.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def latest(out: Path) -> str | None:
    pointer = out / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def rows(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def deterministic(row: dict[str, float]) -> dict[str, float]:
    """The metrics that must repeat exactly (not wall-clock timings or throughputs)."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(("timing/", "perf/", "memory/")) and not k.endswith(("_per_s", "_seconds"))
    }


def assert_same_metrics(out: Path, reference: Path, steps: int = STEPS) -> None:
    """The first ``steps`` rows of metrics.jsonl in ``out`` equal those of ``reference``, each step once."""
    got, want = rows(out / "metrics.jsonl"), rows(reference / "metrics.jsonl")[:steps]
    assert [r["train/step"] for r in got] == [float(s) for s in range(1, steps + 1)]
    for a, b in zip(got, want, strict=True):
        assert deterministic(a) == deterministic(b), a["train/step"]


def assert_same_run(out: Path, reference: Path) -> None:
    """metrics.jsonl, validation.jsonl and the MLflow history of ``out`` equal those of ``reference``."""
    assert_same_metrics(out, reference)
    assert rows(out / "validation.jsonl") == rows(reference / "validation.jsonl")

    from mlflow import MlflowClient

    summary = json.loads((out / "summary.json").read_text())
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the same run was continued
    want = rows(reference / "metrics.jsonl")
    for key in deterministic(want[-1]):
        history = sorted(client.get_metric_history(summary["run_id"], key), key=lambda m: m.step)
        assert [m.step for m in history] == list(range(1, STEPS + 1)), key  # every step once
        assert [m.value for m in history] == pytest.approx([r[key] for r in want], rel=1e-6, abs=1e-12), key


@pytest.fixture(scope="module")
def paths(tiny_model_and_task, tmp_path_factory) -> dict[str, str]:
    return {**tiny_model_and_task, "reward": write_digit_reward(tmp_path_factory.mktemp("reward"))}


@pytest.fixture(scope="module")
def uninterrupted(paths, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    done = train(run_args(paths, out, "trainer.checkpoint.every=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    history = rows(out / "metrics.jsonl")
    assert len(history) == STEPS and history[0]["actor/grad_norm"] > 0  # the policy really moves
    assert len({round(r["actor/loss"], 9) for r in history}) == STEPS
    return out


def test_driver_killed_between_steps_and_during_a_save_resumes_exactly(paths, uninterrupted, tmp_path):
    out = tmp_path / "run"
    args = run_args(paths, out, "trainer.checkpoint.every=2")

    first = train(args, VERITY_DEBUG_CRASH_AT="step_end:3")  # SIGKILL after step 3 (checkpoint at 2)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert latest(out) == "step_2" and len(rows(out / "metrics.jsonl")) == 3
    run_id = json.loads((out / "checkpoints" / "step_2" / "trainer_state.json").read_text())["run_id"]

    second = train(args, VERITY_DEBUG_CRASH_AT="save:4")  # SIGKILL in the middle of saving step 4
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    assert "resuming from" in second.stderr and "step_2" in second.stderr
    assert (out / "checkpoints" / "step_4.tmp").is_dir() and latest(out) == "step_2"

    third = train(args)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "removed an unfinished checkpoint" in third.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_2", "step_4"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_id"] == run_id and summary["resumed_from_step"] == 2
    assert f"resumed from step 2: steps 3-{STEPS} ran now" in third.stdout
    assert json.loads((uninterrupted / "summary.json").read_text())["resumed_from_step"] is None
    assert_same_run(out, uninterrupted)


def test_killed_worker_fails_fast_naming_role_and_rank_and_resume_stops_on_sigterm(
    paths, uninterrupted, tmp_path
):
    out = tmp_path / "run"
    args = run_args(paths, out, "trainer.checkpoint.every=1")
    log = tmp_path / "first.log"
    with open(log, "w") as stderr:
        # both ranks stall 300 s in step 3's update: a hang that only the failure of rank 1 can end
        proc = subprocess.Popen(
            command(args),
            env=environment(VERITY_DEBUG_STALL="update_actor:3:300"),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            wait_for(lambda: latest(out) == "step_2", RUN_TIMEOUT_S, "checkpoint step_2", proc)
            workers = json.loads((out / "workers.json").read_text())["actor"]
            os.kill(workers[1]["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
            code = proc.wait(timeout=240)
            elapsed = time.monotonic() - killed_at
        finally:
            if proc.poll() is None:
                proc.kill()
    message = log.read_text()
    assert code == 1, message[-3000:]
    # ended by the death, long before the stall would end (about 8 s on a quiet machine; the bound leaves
    # room for a machine loaded several times over its cores)
    assert elapsed < 150.0, elapsed
    assert "WorkerDiedError: actor." in message and "rank 1 died" in message
    assert "last complete checkpoint" in message and "step_2" in message

    # resume from step 2; SIGTERM during step 3 (its update stalls 4 s): the run saves step 3, exits 143
    log = tmp_path / "second.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            command(args),
            env=environment(VERITY_DEBUG_STALL="update_actor:1:4"),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            wait_for(lambda: "loaded checkpoint" in log.read_text(), RUN_TIMEOUT_S, "the resume", proc)
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    message = log.read_text()
    assert code == 128 + signal.SIGTERM, message[-3000:]
    assert "resuming from" in message and "step_2" in message
    assert "stopped on SIGTERM after step 3" in message
    assert latest(out) == "step_3"
    assert_same_metrics(out, uninterrupted, steps=3)  # steps 1-2 before the kill, 3 after the resume


def test_export_round_trip_matches_the_trainer_rollout(paths, uninterrupted, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verity.batch import materialize
    from verity.config import load_config
    from verity.controller import ResourcePool, WorkerGroup, init_ray, shutdown_ray
    from verity.data.prompt_loader import PromptDataLoader
    from verity.data.verl_dataset import PromptDataset
    from verity.workers.actor_rollout import ActorRolloutRefWorker

    hf_dir = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-m", "verity.cli.main", "export", str(uninterrupted), str(hf_dir)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step_{STEPS}" in done.stdout
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    initial = AutoModelForCausalLM.from_pretrained(paths["model"])
    assert any(not torch.equal(t, initial.state_dict()[k]) for k, t in model.state_dict().items())

    prompts = PromptDataLoader(
        PromptDataset([paths["test"]], tokenizer, max_prompt_length=32), 16, shuffle=False
    ).next_batch()
    prompts.meta["sampling"] = {"do_sample": False, "temperature": 0.0, "max_new_tokens": 6, "n": 1}

    # the trainer's rollout, in ONE worker, loading the checkpoint that TWO workers wrote
    cfg = load_config(run_args(paths, tmp_path / "unused", "trainer.n_workers=1"))
    init_ray(num_cpus=2)
    pool = ResourcePool([1], cpus_per_bundle=0.5, name="export-check")
    try:
        group = WorkerGroup(pool, ActorRolloutRefWorker, cfg, paths["model"], paths["model"], name="actor")
        group.init_model()
        info = group.load_checkpoint(str(uninterrupted / "checkpoints" / f"step_{STEPS}" / "actor"))
        assert info[0]["saved_world_size"] == 2
        rollout = group.generate(prompts)
        seq = rollout.select("input_ids", "attention_mask", "position_ids", "responses")
        worker_logprobs = group.compute_log_prob(seq)["old_logprobs"]  # the prompt side stayed on the worker
        rollout = materialize(rollout)  # whole rows, fetched through the driver, for the comparison below
        group.shutdown()
    finally:
        pool.remove()
        shutdown_ray()

    with torch.no_grad():
        generated = model.generate(
            input_ids=prompts["input_ids"],
            attention_mask=prompts["attention_mask"],
            do_sample=False,
            max_new_tokens=6,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    width = prompts["input_ids"].shape[1]
    hf_responses = generated[:, width:]
    mask = rollout["response_mask"]
    assert mask.sum() > 0
    for i in range(len(prompts)):
        n = int(mask[i].sum())
        assert hf_responses[i, :n].tolist() == rollout["responses"][i, :n].tolist(), i

    with torch.no_grad():
        logits = model(
            input_ids=rollout["input_ids"],
            attention_mask=rollout["attention_mask"],
            position_ids=rollout["position_ids"],
        ).logits
    responses = rollout["responses"]
    logp = torch.log_softmax(logits[:, width - 1 : -1].float(), -1)
    hf_logprobs = logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(hf_logprobs * mask, worker_logprobs * mask, atol=1e-5, rtol=1e-5)


def test_ctrl_c_saves_at_the_end_of_the_step_and_a_second_ctrl_c_stops_at_once(paths, tmp_path):
    out = tmp_path / "run"
    args = run_args(paths, out)  # trainer.checkpoint.every=0: without the Ctrl-C save, nothing is kept

    def start(stall: str, log: Path) -> subprocess.Popen:
        # a session of its own, so that a Ctrl-C can go to the whole process group, as a terminal sends it
        with open(log, "w") as stderr:
            return subprocess.Popen(
                command(args),
                env=environment(VERITY_DEBUG_STALL=stall),
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )

    log = tmp_path / "first.log"
    proc = start("update_actor:2:4", log)  # step 2's update stalls 4 s: a window to press Ctrl-C
    try:
        wait_for(
            lambda: (out / "metrics.jsonl").is_file() and len(rows(out / "metrics.jsonl")) == 1,
            RUN_TIMEOUT_S,
            "step 1",
            proc,
        )
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    message = log.read_text()
    assert code == 130, message[-3000:]
    assert "stopped on SIGINT (Ctrl-C) after step 2" in message
    assert f"resume with: verity train model.path={paths['model']}" in message
    assert "Traceback" not in message
    assert latest(out) == "step_2"

    log = tmp_path / "second.log"
    proc = start("update_actor:1:300", log)  # the resumed step 3 stalls 300 s
    try:
        wait_for(lambda: "loaded checkpoint" in log.read_text(), RUN_TIMEOUT_S, "the resume", proc)
        time.sleep(2.0)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)
        pressed = time.monotonic()
        code = proc.wait(timeout=240)
        elapsed = time.monotonic() - pressed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    message = log.read_text()
    assert code == 130, message[-3000:]
    assert elapsed < 150, elapsed  # did not wait for the 300 s stall to end
    assert "stopped at once on Ctrl-C" in message and "Traceback" not in message
    assert latest(out) == "step_2"  # nothing half-written replaced the last checkpoint
