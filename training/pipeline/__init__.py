"""The threaded training pipeline: target threads turn micro-batches into features, drafter threads train.

One process, one thread per device entry, in three roles. Each target thread owns a frozen target replica;
each drafter thread owns a drafter replica and its optimizer; each colocated thread owns both, and runs the
target forward and then the drafter step on its own micro-batches (the serial loop, as one role of the same
pipeline: no queue, no copy between devices). Drafter and colocated threads are the replicas. A global step is
M = `micro_batches_per_step` micro-batches; every replica accumulates the gradients of the micro-batches it
took (each loss scaled by 1/M), then at the step boundary the gradients are summed across replicas (NCCL
through torch.cuda.comm on distinct GPUs, a plain sum otherwise), clipped once, and every replica steps its own
optimizer on the same gradients, so the replicas stay bit-identical. A step whose loss or summed gradient is
not finite updates nothing, on every replica alike (they share the sum): its StepReport says what was not
finite, and the micro-batches are spent.

What keeps it correct:
- Order: micro-batch n of the source belongs to step start + n // M, index n % M, whichever thread computes
  it; the source is read in that order. Target threads read ahead (within the bound below); a colocated thread
  reads the next micro-batch only while it belongs to the step it is in. Drafters take the target threads'
  micro-batches of a step in index order, so with one drafter the accumulation order is fixed too.
- Bounded: at most `queue_depth` micro-batches live between a target's claim and a drafter's take; targets may
  run ahead into later steps within that bound, drafters never start step g+1 before their step g update.
- Streams: on CUDA each thread works on its own stream and synchronizes it at the end of every busy span;
  tensors cross threads only after that, and each consumer holds them until its own stream has synchronized.
- Stop: an exception in any thread aborts every wait and ends every thread; `run` raises `PipelineError` with
  that thread's error and traceback, and so does a KeyboardInterrupt in the thread running `run` (Ctrl-C, or
  the trainer's second stop signal). A requested stop (`request_stop`, or the `stop` that `run` polls) ends at
  a step boundary: the current step finishes if all its micro-batches were already done, otherwise it is
  dropped. The pipeline installs no signal handler: the process's entry point owns signals.
- Compile discipline: each thread calls its workers' optional `warm_up()` on its own device, then every thread
  meets at one barrier before steady state (no thread works while another may still be compiling).
- Nodes: in a multi-node run (training/distributed/) this process computes its share of each step's
  micro-batches (each loss scaled by 1 / the step's micro-batches on every node together), and the leader
  replica's thread joins the other processes at the step boundary through `AcrossNodes`: whether every node
  completed the step and whether any stops after it, the gradient all-reduce after the in-process sum and
  before the clip, the sum of the step's loss and metrics. Only that thread talks to other nodes.
- Layouts: target threads need drafter threads and the other way round; colocated threads need neither, so a
  run may be all colocated, all disaggregated (T targets : D drafters), or a mix of the two.
"""

from training.pipeline.core import Pipeline
from training.pipeline.gradients import sum_and_clip_gradients
from training.pipeline.interface import (
    PipelineConfig,
    PipelineError,
    PipelineStalled,
    RunResult,
    StepReport,
    Utilisation,
)

__all__ = ["Pipeline", "PipelineConfig", "PipelineError", "PipelineStalled", "RunResult", "StepReport", "Utilisation",
           "sum_and_clip_gradients"]
