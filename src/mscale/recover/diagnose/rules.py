"""The diagnosis rules as two tables: a pattern or a fact → class, symptom, transient, weight.

One failure leaves many lines: a rank killed by the OOM killer leaves ``Connection reset by
peer`` in every peer's error file; a hung rank leaves ``Timed out waiting`` in all the others.
The *weight* orders the causes: the finding of highest weight explains the rest and decides the
class (ties: the earliest). Root causes weigh most (the scheduler took the job; the input is bad;
the hardware says so), then what the job itself recorded (NaN, a hang, a signal), and least what
a peer sees when another rank dies (resets, timeouts). docs/recover.md prints these tables.

``transient``: a plain relaunch is likely to work (decision.py: `Diagnosis.transient`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mscale.recover.decision import FailureClass, Symptom


@dataclass(frozen=True)
class Rule:
    """What one kind of evidence means."""

    key: str
    """The rule's name (in evidence digests and the docs)."""
    cls: FailureClass
    symptom: Symptom
    transient: bool
    weight: int
    """Which cause explains the others (module docstring)."""
    what: str
    """The cause in a few words, for the summary sentence."""
    pattern: re.Pattern | None = None
    """For text rules: searched in every log, error-file and SLURM-output line."""


def _t(key, pattern, cls, symptom, transient, weight, what) -> Rule:
    return Rule(key, cls, symptom, transient, weight, what, re.compile(pattern, re.IGNORECASE))


TEXT_RULES: tuple[Rule, ...] = (
    # the scheduler ended the job: every other line is a consequence
    _t("slurm_preempted", r"DUE TO PREEMPTION", "preemption", "preempted", True, 100,
       "the job was preempted by SLURM"),
    _t("slurm_time_limit", r"DUE TO TIME LIMIT", "preemption", "preempted", True, 100,
       "the job reached its SLURM time limit"),
    _t("slurm_node_fail", r"DUE TO NODE FAIL|NODE_FAIL|Node failure on", "preemption",
       "preempted", True, 100, "SLURM reported a node failure (NODE_FAIL)"),
    # an operator's scancel; a STEP's cancel that follows a task failure (srun
    # --kill-on-bad-exit) or belongs to a job cancelled DUE TO something is the step being torn
    # down: facts.py turns it into the weak ``step_cancelled`` fact
    _t("slurm_cancelled", r"CANCELLED AT (?!.*DUE TO)", "none", "stopped", False, 95,
       "the job was cancelled (scancel)"),
    # user code and environment: relaunching cannot help
    _t("syntax_error", r"^\s*(SyntaxError|IndentationError|TabError)\b", "user_code", "crash",
       False, 90, "a syntax error in the code"),
    _t("import_error", r"^\s*(ImportError|ModuleNotFoundError)\b", "user_code", "crash", False,
       90, "an import failed (code or environment)"),
    # the device says it is broken (NVIDIA Xid catalog; ECC; CUDA's fatal kernel errors)
    _t("xid", r"NVRM: Xid\b", "gpu", "crash", False, 85, "the GPU driver reported an Xid error"),
    _t("ecc", r"uncorrectable ECC|ECC error|double[- ]bit ECC|ecc_uncorrectable|"
       r"cudaErrorECCUncorrectable|CUDA_ERROR_ECC_UNCORRECTABLE", "gpu", "crash", False, 85,
       "an uncorrectable ECC memory error"),
    _t("gpu_fault", r"illegal memory access|unspecified launch failure|"
       r"GPU has fallen off the bus|illegal instruction was encountered|misaligned address",
       "gpu", "crash", False, 85, "a GPU fault"),
    # storage
    _t("enospc", r"No space left on device|(?-i:\bENOSPC\b)|Disk quota exceeded|(?-i:\bEDQUOT\b)|"
       r"the disk is full",
       "storage", "disk_full", False, 80, "the filesystem is full"),
    _t("eio", r"Input/output error|(?-i:\bEIO\b)", "storage", "crash", False, 80,
       "an I/O error on the filesystem"),
    _t("stale_handle", r"Stale file handle|(?-i:\bESTALE\b)", "storage", "crash", True, 80,
       "a stale network-filesystem handle"),
    _t("read_only", r"Read-only file system|(?-i:\bEROFS\b)", "storage", "crash", False, 80,
       "the filesystem went read-only"),
    # a remote training.data store that stayed down past data.remote_retry_s (data/storage.py's
    # words): its error file says bad_input (an MscaleError, exit 3), but the input is fine and
    # a relaunch resumes once the store answers, so it outweighs the bad_input fact
    # Local paths are listed through the same retries: there only a timeout (a hung network
    # mount) is a store down; a too-long name, a symlink loop or EIO is not fixed by a relaunch
    _t("data_store_down", r"[a-z][\w+.-]*://[^\n]*?failed after \d+ attempts? \(timeout "
       r"[\d.e+]+ s each\)|failed after \d+ attempts? \(timeout [\d.e+]+ s each\); last error: "
       r"TimeoutError", "storage", "crash", True, 92,
       "the remote data store did not answer (training.data)"),
    _t("no_permission", r"\[Errno 13\] Permission denied|(?-i:\bEACCES\b)", "storage",
       "crash", False, 55, "a file of the run could not be written: permission denied"),
    # memory
    _t("cuda_oom", r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError|"
       r"CUBLAS_STATUS_ALLOC_FAILED",
       "software", "oom", False, 75, "the device ran out of memory"),
    _t("host_oom", r"oom[-_ ]kill|Out of memory: Kill|Memory cgroup out of memory|"
       r"Killed process \d+", "software", "oom", False, 75,
       "the kernel's OOM killer ended a process"),
    _t("nccl_cuda", r"ncclUnhandledCudaError", "gpu", "crash", False, 70,
       "NCCL hit a CUDA error"),
    _t("cuda_error", r"CUDA error|cudaError\w*|CUDA_ERROR_\w+", "gpu", "crash", False, 70,
       "a CUDA error"),
    _t("killed_line", r"^\s*Killed\s*$", "software", "oom", False, 45,
       "a process was SIGKILLed ('Killed', most often the OOM killer)"),
    # the network itself failed (not merely a peer that went away)
    _t("nccl_error", r"ncclSystemError|ncclInternalError|ncclRemoteError|NCCL error|"
       r"NET/IB\s*:.*(error|failed)|ibv_\w+ failed|transport retry counter exceeded",
       "network", "crash", True, 30, "a NCCL/InfiniBand error"),
    _t("rendezvous", r"DistNetworkError|Connection refused|RendezvousTimeoutError|"
       r"RendezvousConnectionError|rendezvous.*(failed|timed out)", "network", "crash", True,
       30, "the job could not connect its ranks"),
    # what a peer sees when another rank dies or hangs: a consequence, the weakest evidence
    _t("peer_gone", r"Connection reset by peer|Connection closed by peer|Broken pipe|"
       r"(?-i:\bECONNRESET\b)", "network", "crash", True, 15, "a peer's connection was lost"),
    _t("collective_timeout", r"Timed out waiting|Watchdog caught collective operation timeout|"
       r"ran for \d+ milliseconds before timing out|collective operation timeout|"
       r"DistStoreError.*timeout", "network", "timeout", True, 15,
       "a collective timed out"),
)
"""Text rules, searched in log tails, error-file messages, torchelastic messages, SLURM output
and checkpoint-failure events."""


def _f(key, cls, symptom, transient, weight, what) -> Rule:
    return Rule(key, cls, symptom, transient, weight, what)


FACT_RULES: dict[str, Rule] = {r.key: r for r in (
    _f("finished", "none", "finished", False, 200, "the run finished every step"),
    _f("bad_input", "user_code", "bad_input", False, 90,
       "bad input (a plan, a checkpoint, a data file)"),
    _f("ckpt_damaged", "storage", "damaged_checkpoint", False, 90,
       "the checkpoint the job was resuming from is damaged"),
    _f("user_frame", "user_code", "crash", False, 90, "an error raised in user code"),
    _f("disk_full", "storage", "disk_full", False, 80, "the filesystem is full"),
    _f("xid_application", "software", "crash", False, 60,
       "an Xid error the application or the driver can cause"),
    _f("nan", "numerics", "nan", True, 65, "the loss or gradients became NaN/Inf"),
    _f("divergence", "numerics", "divergence", False, 65, "the loss diverged"),
    _f("hang", "unknown", "hang", False, 50, "a rank stopped answering (hang)"),
    _f("interrupted", "none", "stopped", False, 45,
       "the operator interrupted the job (Ctrl-C twice, or a stop during start-up)"),
    _f("launcher_died", "preemption", "preempted", True, 42,
       "the --local launcher died (killed or crashed) and its workers stopped themselves"),
    _f("killed", "unknown", "signal", True, 40, "a rank was killed by a signal"),
    _f("terminated", "preemption", "preempted", True, 40,
       "a rank was terminated from outside (SIGTERM/SIGINT)"),
    _f("straggler", "gpu", "straggler", False, 35,
       "a slow device or node was found, its node quarantined"),
    _f("slow_link", "network", "straggler", False, 35, "a slow link was found"),
    _f("spikes", "numerics", "divergence", False, 25, "repeated gradient-norm spikes"),
    _f("console", "software", "crash", True, 22,
       "a rank's console (stdout/stderr) was closed under it"),
    _f("crash", "software", "crash", False, 20, "a rank raised an exception"),
    _f("ckpt_failed", "storage", "crash", False, 18, "a checkpoint could not be written"),
    _f("timeout", "network", "timeout", True, 15, "a collective timed out"),
    _f("network", "network", "crash", True, 15, "a connection between ranks was lost"),
    _f("signalled", "preemption", "preempted", True, 12,
       "the job was stopped by a signal (SIGTERM/SIGUSR1: the scheduler)"),
    _f("halted", "none", "stopped", False, 10, "the job was stopped on request"),
    _f("exit_nonzero", "unknown", "crash", False, 5, "a rank exited with an error"),
    _f("step_cancelled", "unknown", "crash", False, 2,
       "SLURM tore the job step down after a task failed (srun --kill-on-bad-exit)"),
)}
"""Fact rules: what the job's own records say (events, error-file kinds, the launcher's view)."""

NOTHING = _f("nothing", "unknown", "unknown", False, 0, "no failure was recorded")

XID_APPLICATION = frozenset({13, 31, 43, 45})
"""Xid codes for which NVIDIA's Xid catalog lists the application or the driver among the causes
(13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing) or which
follow an earlier error (45 preemptive cleanup): alone they do not condemn the device
(docs/references.md, "Xid errors")."""
XID_NUMBER = re.compile(r"NVRM: Xid\b(?:\s*\([^)]*\))?[\s:,]*(\d+)")

SPIKE_GAP_STEPS = 20
"""Gradient spikes at most this many steps apart belong to one episode; two or more in an
episode make "repeated spikes", which a rollback treats like a divergence."""

CKPT_DAMAGE = re.compile(
    r"checksum mismatch|zstd frame does not decode|decodes to \d+ bytes, expected|"
    r"file ends (\d+ bytes )?early|\d+ bytes stored, \d+ expected|"
    r"stored chunk sizes do not match|file has \d+ bytes, the manifest says|"
    r"slices cover \d+ of \d+ elements|not a regular file|damaged or was altered|"
    r"does not match the commit marker|: missing(;|$)", re.IGNORECASE)
"""What the checkpoint package says of a damaged checkpoint file as a resume reads it
(ckpt/format.py's chunk errors, files.open_shard, load.py, the manifest checks' fix
``untrusted.DAMAGED``): the bytes on disk are wrong, whoever reads them. Together with a path
inside a checkpoint directory (`CKPT_DIR`), an error file of kind ``bad_input`` saying it is
the ``ckpt_damaged`` fact, not bad input: a rollback to an older checkpoint gets past it. What is
wrong with the checkpoint *for this job* (a tensor it lacks, a shape of another model, not
committed) says none of these and stays ``bad_input``; so does a read error (``Input/output
error``), which may be the reading node's mount rather than the file."""

CKPT_DIR = re.compile(r"(?:^|(?<=[\s'\"(=]))(?P<dir>(?:[^\s'\"()]*/)?step-\d{6,})"
                      r"(?=[/'\":;,\s)]|$)")
"""A checkpoint directory (``…/step-NNNNNN``, `mscale.ckpt.catalog.STEP_DIR`) in a message or a
path: the first one named is the checkpoint the failure is about."""
