"""The run's components: built once, called after every step (in the leader drafter thread), closed at the
end. The step log and its evaluation, the bad-step guard, the end-of-run export (the checkpoint policy is
training/trainer/checkpointing.py's), and RunComponents, which builds them all and calls them in order."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable

import torch

from training.config import TrainConfig
from training.console import say, warn
from training.data.chat import eval_prompts
from training.distributed import Nodes, SingleNode
from training.output.metrics import MetricsLog, metrics_path
from training.output.reporters import Reporters
from training.output.run_home import run_record
from training.pipeline import RunResult, StepReport, Utilisation
from training.serve.evaluate import acceptance_length, build_eval_set
from training.serve.export import export_run
from training.target.frozen import Target
from training.trainer.batches import StepBatches, step_flops
from training.trainer.checkpointing import CheckpointPolicy
from training.trainer.replicas import DrafterReplica
from training.trainer.world import World


def peak_memory_gib(devices: list[torch.device]) -> dict[str, float]:
    """Peak memory so far per device: allocated by torch on each GPU; the process's peak RSS for the CPU."""
    peaks = {}
    for device in dict.fromkeys(devices):
        if device.type == "cuda":
            peaks[str(device)] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        else:
            peaks[str(device)] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return peaks


class StepLog:
    """The run's numbers. Built once; `start` before the first step, `steady` when the pipeline's threads have
    warmed up, `after_step` after every step (in the leader drafter thread): loss, accuracy, tokens and
    counted FLOPs add up over a window (loss and accuracy over the steps that updated; skipped ones are
    counted), and every `log_every`-th step (and the last) writes one metrics record, the JSON line and the
    progress line, with the layout and each device's peak memory; a step the evaluation is due at adds the
    acceptance length τ (Evaluation) to that record. In a multi-node run the nodes exchange their window's
    tokens, FLOPs and busy fractions at each record: node 0's record is the run's (and evaluates), each other
    node writes its own figures to its own file (metrics_path). Node 0 also hands every record to the reporters
    config.report_to names (TensorBoard, W&B, MLflow); `close` at the end closes them."""

    def __init__(self, config: TrainConfig, leader: DrafterReplica, batches: StepBatches, world: World,
                 evaluation: Evaluation, nodes: Nodes | SingleNode):
        self.config, self.leader, self.batches, self.evaluation = config, leader, batches, evaluation
        self.layout, self.devices, self.choice, self.nodes = world.layout, world.devices, world.choice, nodes
        self.metrics = MetricsLog(metrics_path(config.output_dir, nodes.rank), config.max_steps)
        self.reporters = Reporters(config, writes=nodes.leader)
        self.skipped_total = 0  # steps skipped for a non-finite loss or gradient, since this process started
        self._records = 0
        self._open_window()

    def start(self, step: int) -> None:
        """On a fresh run, the untrained drafter's τ: the baseline every later one is compared with."""
        if step == 0 and self.evaluation.enabled:
            self._write(0, acceptance_length=self.evaluation())
        self._open_window()

    def steady(self) -> None:
        """Every thread has compiled and warmed up: time from here (the first window leaves warm-up out)."""
        self._start = time.time()

    def after_step(self, report: StepReport, utilisation: Callable[[], Utilisation]) -> None:
        """Count step `report.step`; `utilisation` (the pipeline's, since its previous call) is asked once a
        window."""
        done, last = report.step, report.step == self.config.max_steps
        if report.skipped is None:
            self._loss += report.loss
            self._accuracy += report.metrics["accuracy"]
            self._steps += 1
        else:
            self._skipped += 1
            self.skipped_total += 1
        tokens, flops = self.batches.pop_tokens(done - 1)
        self._tokens += tokens
        self._flops += flops
        record = {}
        if done % self.config.log_every == 0 or last:
            record = self._close_window(report, utilisation())
        if self.evaluation.due(done):
            record["acceptance_length"] = self.evaluation()
        if record:
            self._write(done, **record)

    def close(self) -> None:
        self.reporters.close()

    def _write(self, step: int, **values) -> None:
        self.reporters.write(step, self.metrics.write(step, **values))

    def _open_window(self) -> None:
        self._loss, self._accuracy, self._steps, self._skipped = 0.0, 0.0, 0, 0
        self._tokens, self._flops = 0, 0.0
        self._start = time.time()

    def _close_window(self, report: StepReport, utilisation: Utilisation) -> dict:
        elapsed = max(time.time() - self._start, 1e-9)
        tokens_per_s, tflops_per_s = self._tokens / elapsed, round(self._flops / elapsed / 1e12, 3)
        tokens_per_s, tflops_per_s, spread = self.nodes.combine_figures(
            report.step, tokens_per_s, tflops_per_s, utilisation.as_metrics()["busy"])
        record = {"lr": self.leader.last_lr, "tokens_per_s": tokens_per_s, "tflops_per_s": tflops_per_s,
                  "skipped_steps": self._skipped, "skipped_steps_total": self.skipped_total,
                  **utilisation.as_metrics(), "layout": self.layout.name,
                  "peak_memory_gib": peak_memory_gib(self.devices), **spread}
        if self._steps:  # a window of skipped steps only has no loss (JSON has no NaN)
            record.update(loss=self._loss / self._steps, accuracy=self._accuracy / self._steps)
        if report.skipped is None:
            record["grad_norm"] = report.grad_norm
        if self.choice is not None:
            record["predicted_tokens_per_s"] = round(self.choice.chosen.tokens_per_s, 1)
        if self._records == 0:  # the whole layout once, and auto's measurements and candidates
            record["layout_detail"] = self.layout.as_dict()
            if self.choice is not None:
                record["layout_auto"] = self.choice.as_dict()
        elif self._records == 1 and self.choice is not None:  # the first window without the pipeline's fill
            say(f"layout auto: {self.layout.name}: measured {tokens_per_s:.0f} tokens/s, predicted "
                f"{self.choice.chosen.tokens_per_s:.0f}")
        self._records += 1
        self._open_window()
        return record


class Evaluation:
    """The acceptance length τ on the held-out prompts (training/serve/evaluate.py), on node 0: built once (the
    prompts drafted on, prepared on the leader's device), asked by the step log every `eval_every`-th step and
    at the last; on a fresh run, also before the first step (the untrained drafter's τ, the baseline)."""

    def __init__(self, config: TrainConfig, leader: DrafterReplica, target: Target, held_out: list[list[dict]],
                 leads: bool):
        self.config, self.leader = config, leader
        self.evalset = None
        if config.eval_every and held_out and leads:
            prompts = eval_prompts(target.tokenizer, held_out, {"enable_thinking": config.enable_thinking})
            self.evalset = build_eval_set(target, prompts, config.eval_new_tokens, leader.device)

    @property
    def enabled(self) -> bool:
        return self.evalset is not None

    def due(self, step: int) -> bool:
        return self.enabled and (step % self.config.eval_every == 0 or step == self.config.max_steps)

    def __call__(self) -> float:
        return acceptance_length(self.leader.drafter, self.evalset, self.leader.dtype)


class NonFiniteSteps(RuntimeError):
    """max_bad_steps steps in a row had a non-finite loss or gradient: the run stops (TrainExit.NON_FINITE)."""


class BadStepGuard:
    """Steps the pipeline skipped for a non-finite loss or gradient (no update; the data moves on). Built
    once; `after_step` after every step (in the leader drafter thread) says each one, and the `max_bad_steps`-th
    in a row raises NonFiniteSteps, which stops every thread. The count starts again on resume."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps
        self.in_a_row = 0

    def after_step(self, report: StepReport) -> None:
        if report.skipped is None:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.in_a_row >= self.max_bad_steps:
            raise NonFiniteSteps(
                f"step {report.step}: non-finite {report.skipped}; {self.in_a_row} steps in a row skipped "
                f"(max_bad_steps={self.max_bad_steps}); the weights are those after step "
                f"{report.step - self.in_a_row}, the latest checkpoint is intact")
        warn(f"step {report.step}: non-finite {report.skipped}: update skipped ({self.in_a_row} in a row, "
             f"max_bad_steps={self.max_bad_steps})")


class EndOfRunExport:
    """The served format (training/serve/export.py), written once the run reached max_steps (not after a stop), by
    the node that writes the run's files."""

    def __init__(self, config: TrainConfig, writes: bool):
        self.config, self.writes = config, writes

    def close(self, result: RunResult) -> None:
        if self.writes and not result.stopped:
            export_run(self.config.output_dir)


class RunComponents:
    """One run's components on this node, built whole once its world is built and it resumed: the step batches
    they share, the step log with its evaluation, the bad-step guard, the checkpoint policy and the end-of-run
    export. The leader replica's thread calls `after_step` after every step; node 0 writes the run's files."""

    def __init__(self, config: TrainConfig, nodes: Nodes | SingleNode, world: World, share: list[int], step: int,
                 run_home: str):
        leader, writes = world.replicas[0], nodes.leader
        self.config, self.nodes = config, nodes
        self.batches = StepBatches(world.stream, config.micro_batches_per_step(), step,
                                   step_flops(config, world.targets[0], leader.drafter.config), share=share)
        self.evaluation = Evaluation(config, leader, world.targets[0], world.held_out, leads=writes)
        self.step_log = StepLog(config, leader, self.batches, world, self.evaluation, nodes)
        self.step_log.start(step)
        self.bad_steps = BadStepGuard(config.max_bad_steps)
        self.checkpoints = CheckpointPolicy(config, leader, self.batches, step, writes=writes,
                                            run=run_record(run_home))
        self.export = EndOfRunExport(config, writes=writes)

    def on_steady(self, world: World) -> None:
        """Every pipeline thread has warmed up, none has started: time and count compiles from here."""
        self.step_log.steady()
        if world.compiled is not None:
            world.compiled.steady()

    def after_step(self, report: StepReport, utilisation: Callable[[], Utilisation]) -> None:
        """In the leader replica's thread, after every step: the components in order."""
        self.step_log.after_step(report, utilisation)
        self.bad_steps.after_step(report)
        self.checkpoints.after_step(report.step)
        if self.leader_works_after(report.step):
            self.nodes.wait_for_leader(f"step {report.step} checkpoint or evaluation")

    def leader_works_after(self, done: int) -> bool:
        """Node 0 checkpoints or evaluates after step `done`: the others wait for it with the long timeout."""
        eval_every = self.config.eval_every
        return self.checkpoints.due(done) or bool(eval_every and done % eval_every == 0)
