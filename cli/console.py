"""What `batchrl run` shows a user: one line per asset as it finishes, then a summary.

Everything else a run prints (Dagster's DEBUG events, library warnings, progress bars, the trainer
subprocesses' DeepSpeed output) goes to a log file (``common.log_file``). Dagster's event log stays in the
instance (and the UI); the progress lines are read from it, not from the console.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import sys
import threading
import time
from typing import IO

from batchrl.cli.evaluation_report import evaluation_table, format_value, tiny_default_config, tiny_default_note

CHECK_BLOCKED_ERROR = "DagsterAssetCheckFailedError"  # a step's error when one of its blocking checks failed
# a Pipes job's exception, which Dagster records as an engine event of the step before failing it with only
# "External execution process failed with code 1"
PIPES_JOB_ERROR = "[pipes] external process pipes closed with exception"
INGEST_COUNTS = ("rows_in", "valid", "quarantined", "duplicates")  # every input row is one of the three
# the asset the end-of-run hint audits: the first of these the run materialised, else the last asset it did
AUDIT_FIRST = ("policy_checkpoint", "dpo_checkpoint", "offline_policy_checkpoint", "kto_checkpoint", "reward_model")

# a few numbers worth a glance per asset (the rest is in the UI and the audit)
HEADLINE = {
    "raw_logs": ("files", "bytes_in"), "cleaned_logs": ("rows_in", "quarantined"),
    "validated_preferences": ("valid", "quarantined", "duplicates"), "scored_logs": INGEST_COUNTS,
    "feedback_logs": INGEST_COUNTS, "scored_pairs": ("valid",), "prompts": ("rows",), "base_model": ("num_parameters",),
    "reward_model": ("pairs", "train_accuracy_after"), "rollouts": ("samples", "mean_response_tokens"),
    "rewards": ("mean_reward",), "advantages": ("estimator", "adv_abs_mean"),
    "policy_checkpoint": ("global_step", "final/pg_loss", "final/ppo_kl"), "dpo_pairs": ("pairs",),
    "reference_logprobs": ("num_pairs", "mean_ref_chosen_logp"),
    "dpo_checkpoint": ("global_step", "final/loss", "final/rewards/accuracies"),
    "evaluation": ("policy_checkpoint/arith_accuracy", "dpo_checkpoint/logratio_accuracy"),
}


def asset_line(index: int, total: int, asset: str, seconds: float, ok: bool, metadata: dict,
               error: str = "", blocked: list[str] | None = None) -> str:
    mark = "ok  " if ok else "FAIL"
    head = f"[{index:>2}/{total}] {mark} {asset:<22} {seconds:6.1f} s"
    if not ok:
        return f"{head}  {failure_line(error)}"
    version = metadata.get("data_version", "")
    shown = [f"{k.removeprefix('final/')}={format_value(metadata[k])}" for k in HEADLINE.get(asset, ()) if k in metadata]
    if blocked:  # published, but a blocking check failed: Dagster fails the step and skips what follows
        shown.append(f"(published; blocking check {', '.join(blocked)} FAILED: downstream not run)")
    return wrapped(f"{head}  {version:<16} ", shown)


CONSOLE_WIDTH = 100  # the run's lines, the evaluation table's too, fit a terminal of 100 columns
CONTINUATION = " " * 8  # as the check lines under an asset's line


def wrapped(start: str, items: list[str], width: int = CONSOLE_WIDTH) -> str:
    """``start`` and then ``items`` separated by spaces; an item that would pass ``width`` begins a line of its own,
    indented by ``CONTINUATION``."""
    lines, line = [], start
    for item in items:
        if len(line) + 1 + len(item) > width:
            lines.append(line.rstrip())
            line = CONTINUATION + item
        else:
            line = f"{line} {item}"
    lines.append(line.rstrip())
    return "\n".join(lines)


# a path or URI with folders: /a/b/file.csv, s3://bucket/key/file.csv (its last part is group 1)
_LONG_PATH = re.compile(r"(?:[a-z][a-z0-9+.-]*://|/)[^\s:'\"()\[\],]*/([^\s:'\"()\[\],/]+)")


def failure_line(error: str, width: int = 160) -> str:
    """An error's last line (the cause, under Dagster's wrapping) in ``width`` characters. Too long, its paths
    are shortened to their file name, then a trailing ``(hint)`` goes, and only then is it cut, so the part a
    user acts on (``missing fields [...]``) stays on the line; the whole message is in the log and the UI."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    if len(line) > width:
        line = _LONG_PATH.sub(lambda match: "…/" + match.group(1), line)
    if len(line) > width:
        line = re.sub(r"\s*\([^()]*\)$", "", line)
    return line if len(line) <= width else line[:width - 1] + "…"


class RunProgress:
    """Follows one run's event log and writes a line per finished asset step (and per check)."""

    def __init__(self, instance, run_id: str, assets: set[str], out: IO[str], poll_s: float = 0.5):
        self.instance, self.run_id, self.out, self.poll_s = instance, run_id, out, poll_s
        self.assets, self.total = assets, len(assets)
        self.done: list[dict] = []  # {asset, ok, seconds, metadata, error, blocked}; step_only: not an asset
        self._lines = 0  # asset lines written: the N of [N/total]
        self._started: dict[str, float] = {}
        self._metadata: dict[str, dict] = {}
        self._checks: dict[str, list[str]] = {}  # check lines of a step still running
        self._blocking_failed: dict[str, dict[str, list[str]]] = {}  # step -> asset -> its failed blocking checks
        self._job_errors: dict[str, str] = {}  # step -> the exception its Pipes job ended with
        self._cursor = None
        self._stop = threading.Event()
        self._lock = threading.RLock()  # the follower thread and follow()/__exit__ must not read one cursor twice
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> "RunProgress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # whatever arrived after the last poll
        for step in list(self._checks):  # checks of a step that never finished
            self._write_checks(step)

    def _step_progress(self, entry) -> None:
        """On a terminal, a live ``step N loss x`` line for a training stage, replaced by its result line."""
        if not getattr(self.out, "isatty", lambda: False)() or not entry.step_key:
            return
        text = _progress_text(entry)
        if text:
            self.out.write(f"\r        {entry.step_key}: {text}   ")
            self._live = True

    def _clear_progress(self) -> None:
        if getattr(self, "_live", False):
            self.out.write("\r" + " " * 78 + "\r")
            self._live = False

    def follow(self, run_id: str) -> None:
        """Switch to the next run of the same command (one per log drop, then the rest)."""
        with self._lock:
            with contextlib.suppress(Exception):
                self.poll()
            self.run_id, self._cursor = run_id, None

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            with contextlib.suppress(Exception):  # the run may not have written its first event yet
                self.poll()

    def poll(self) -> None:
        with self._lock:
            while True:
                conn = self.instance.get_records_for_run(self.run_id, cursor=self._cursor, limit=200)
                for record in conn.records:
                    self._handle(record.event_log_entry)
                self._cursor = conn.cursor
                if not conn.has_more:
                    return

    def _handle(self, entry) -> None:
        event = entry.dagster_event
        if event is None:
            self._step_progress(entry)
            return
        if not event.step_key:
            return
        step, kind = event.step_key, event.event_type_value
        if kind == "STEP_START":
            self._started[step] = entry.timestamp
        elif kind == "ENGINE_EVENT" and event.message == PIPES_JOB_ERROR and event.engine_event_data.error:
            self._job_errors[step] = error_text(event.engine_event_data.error)
        elif kind == "ASSET_MATERIALIZATION":
            mat = event.event_specific_data.materialization
            self._metadata.setdefault(step, {})[mat.asset_key.to_user_string()] = \
                {k: getattr(v, "value", v) for k, v in mat.metadata.items()}
        elif kind == "STEP_FAILURE" or (kind == "STEP_SUCCESS" and (step in self.assets or step in self._metadata)):
            failure = None if kind == "STEP_SUCCESS" else event.event_specific_data.error
            # a failed job's own exception says why; the step's error only that the job's process failed
            error = "" if failure is None else self._job_errors.pop(step, None) or _root_cause(failure)
            seconds = entry.timestamp - self._started.get(step, entry.timestamp)
            # a multi-asset step (a log drop: raw_logs, cleaned_logs, validated_preferences) gives a line each
            materialised = {a: m for a, m in self._metadata.pop(step, {}).items() if a in self.assets}
            blocked = self._blocking_failed.pop(step, {})
            # a failed blocking check fails its step after the step published its assets: they are there
            ok = failure is None or bool(materialised and blocked and failure.cls_name == CHECK_BLOCKED_ERROR)
            if not materialised and step not in self.assets:  # a step of its own for checks: no asset to count
                self._check_step_failed(step, seconds, failure, error)
                return
            for asset, metadata in (materialised or {step: {}}).items():  # not promoted_policy: not a step
                item = {"asset": asset, "ok": ok, "seconds": seconds, "metadata": metadata, "error": error,
                        "blocked": blocked.get(asset, [])}
                self.done.append(item)
                self._clear_progress()
                self._lines += 1
                self.out.write(asset_line(self._lines, self.total, asset, seconds, ok, metadata, error,
                                          item["blocked"]) + "\n")
            self._write_checks(step)  # a step's checks, under the assets they check
        elif kind == "STEP_SUCCESS":  # a step of its own for checks
            self._write_checks(step)
        elif kind == "ASSET_CHECK_EVALUATION":
            check = event.event_specific_data
            if not check.passed and check.blocking:
                self._blocking_failed.setdefault(step, {}).setdefault(check.asset_key.to_user_string(), []) \
                    .append(check.check_name)
            line = f"        check {check.check_name}: {'passed' if check.passed else 'FAILED'}\n"
            if step in self._started:  # evaluated inside the step: shown when the step's assets are
                self._checks.setdefault(step, []).append(line)
            else:
                self._clear_progress()
                self.out.write(line)


    def _check_step_failed(self, step: str, seconds: float, failure, error: str) -> None:
        """A failed step that is none of the run's assets (an asset check's own step, the log-drop op before it
        published anything): in the summary's failures, but no ``[N/total]`` line (it was not counted: the line read
        ``[ 2/1] FAIL``). A blocking check's failure is its check line (``check ...: FAILED``) already."""
        self.done.append({"asset": step, "ok": False, "seconds": seconds, "metadata": {}, "error": error,
                          "blocked": [], "step_only": True})
        self._clear_progress()
        if failure.cls_name != CHECK_BLOCKED_ERROR or step not in self._checks:
            self.out.write(f"        step {step} FAILED after {seconds:.1f} s: {failure_line(error)}\n")
        self._write_checks(step)

    def _write_checks(self, step: str) -> None:
        lines = self._checks.pop(step, [])
        if lines:
            self._clear_progress()
            self.out.write("".join(lines))


def _progress_text(entry) -> str | None:
    """``step 12 loss 0.31`` from a trainer's per-step log line (JSON with a "step"), else None."""
    import json

    message = (entry.user_message or "").strip()
    if not message.startswith('{"step"'):
        return None
    try:
        record = json.loads(message)
    except ValueError:
        return None
    loss = next((record[k] for k in ("loss", "pg_loss", "final/loss") if isinstance(record.get(k), (int, float))), None)
    return f"step {record['step']}" + (f"  loss {loss:.4g}" if loss is not None else "")


def _root_cause(error) -> str:
    """The innermost error's message (Dagster wraps the asset's exception in a step error)."""
    while error is not None and error.cause is not None:
        error = error.cause
    return "" if error is None else error_text(error)


def error_text(error) -> str:
    """A recorded error as the console shows it: ``Class: message``, the class without its module path (the
    message Dagster records already starts with it); a ``dg.Failure``'s message alone, written for the user."""
    text = (error.message or "").strip()
    named = re.match(r"([\w.]+\.)?(\w+): ", text)
    if named and named.group(2) == error.cls_name:
        return text[named.end():] if error.cls_name == "Failure" else f"{error.cls_name}: {text[named.end():]}"
    return f"{error.cls_name}: {text}" if error.cls_name else text


def summary_table(rows: list[dict]) -> str:
    """Markdown-ish table of every asset step of the run(s): status, seconds, data version."""
    lines = [f"{'asset':<22} {'status':<6} {'seconds':>8}  data version",
             f"{'-' * 22} {'-' * 6} {'-' * 8}  {'-' * 16}"]
    for row in rows:
        lines.append(f"{row['asset']:<22} {'ok' if row['ok'] else 'FAIL':<6} {row['seconds']:8.1f}  "
                     f"{row['metadata'].get('data_version', '')}")
    return "\n".join(lines)


def run_log_path(home: str) -> str:
    return os.path.join(home, "logs", time.strftime("run-%Y%m%d-%H%M%S.log"))


def quiet_libraries() -> None:
    """Environment for quiet child processes (tokenizers/transformers/DeepSpeed read these)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def print_run_summary(done: list[dict], success: bool, seconds: float, log_path: str | None, latest_uri,
                      out: IO[str] | None = None, dagster_home: str | None = None) -> None:
    """After the run: the outcome, the evaluation table with one sample answer per model, where things are."""
    import json

    out = out or sys.stdout
    failed = [d for d in done if not d["ok"]]
    steps = ", ".join(d["asset"] for d in failed if d.get("step_only"))  # a check's own step: not an asset
    assets_failed = sum(not d.get("step_only") for d in failed)
    out.write(f"\n{'SUCCESS' if success else 'FAILED'}: {sum(d['ok'] for d in done)} assets materialised"
              f"{f', {assets_failed} failed' if assets_failed else ''}{f', step {steps} failed' if steps else ''}"
              f" in {seconds:.0f} s\n")
    for item in failed:  # a cause cut on its asset line, whole (its traceback is in the log)
        whole = failure_line(item.get("error", ""), width=sys.maxsize)
        if whole != failure_line(item.get("error", "")):
            out.write(f"  {item['asset']} failed: {whole}\n")
    for item in done:
        if item.get("blocked"):
            out.write(f"  {item['asset']} was published, but its blocking check {', '.join(item['blocked'])} failed: "
                      "the assets downstream of its step did not run\n")
    if not success and log_path and os.path.exists(log_path):
        with open(log_path, errors="replace") as f:
            tail = f.readlines()[-15:]
        out.write(f"last lines of {log_path}:\n" + "".join("  " + line for line in tail))
    evaluation = latest_uri("evaluation")
    if evaluation and success:
        with open(os.path.join(evaluation, "evaluation.json")) as f:
            report = json.load(f)
        out.write("\n" + "\n".join(evaluation_table(report)) + "\n")
        for model, metrics in report.items():
            for ex in metrics.get("examples", [])[:1]:
                out.write(f"  {model}: {ex['prompt'][:40]!r} -> {ex['response'][:40]!r} (gold {ex['answer']})\n")
        tiny = tiny_default_config(latest_uri("base_model"))
        if tiny is not None:
            out.write(tiny_default_note(tiny))
    out.write("\n")
    for asset in ("validated_preferences", "policy_checkpoint", "dpo_checkpoint", "evaluation"):
        if latest_uri(asset):
            out.write(f"{asset:>22}: {latest_uri(asset)}\n")
    if log_path:
        out.write(f"{'log':>22}: {log_path}\n")
    out.write(command_hints(dagster_home or os.environ.get("DAGSTER_HOME") or ".dagster_home",
                            audited=audited_asset(done)))


def audited_asset(done: list[dict]) -> str | None:
    """The asset the hints audit: one this run materialised (a checkpoint first), None when it materialised none."""
    built = [item["asset"] for item in done if item.get("ok") and item.get("asset")]
    return next((asset for asset in AUDIT_FIRST if asset in built), built[-1] if built else None)


def command_hints(dagster_home: str, argv0: str | None = None, audited: str | None = None) -> str:
    """The next commands, as this environment runs them: the DAGSTER_HOME in use, batchrl as it was invoked;
    ``audited``: the asset to audit and reproduce (one the run materialised; None: no such hint)."""
    batchrl = invoked_as(argv0)
    dagster = os.path.join(os.path.dirname(sys.executable), "dagster")  # beside this interpreter: its environment's
    dagster = _program(dagster) if os.path.exists(dagster) else "dagster"
    audit = (f"audit:  {batchrl} audit {audited}\nreproduce:  {batchrl} reproduce {audited}\n" if audited else "")
    return (f"{audit}UI:     DAGSTER_HOME={shlex.quote(os.path.abspath(dagster_home))} {dagster} dev   "
            "(then open http://127.0.0.1:3000)\n")


def invoked_as(argv0: str | None = None) -> str:
    """How to call this batchrl again (``argv0``: default ``sys.argv[0]``): ``python -m batchrl.cli`` when it
    ran as a module (``cli/__main__.py``), else its program, by name when PATH finds that same file."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if not argv0 or argv0 in ("-c", "-m") or os.path.basename(argv0) == "__main__.py":
        return f"{_path_shown(sys.executable)} -m batchrl.cli"
    return _program(argv0)


def _program(path: str) -> str:
    """A program's name when PATH finds this same file (or it was called by name), else its path."""
    name, found = os.path.basename(path), shutil.which(os.path.basename(path))
    if os.sep not in path or (found and os.path.realpath(found) == os.path.realpath(path)):
        return name
    return _path_shown(path)


def _path_shown(path: str) -> str:
    """``path`` relative to the working folder when under it (``.venv/bin/batchrl``), else absolute."""
    path = os.path.abspath(path)
    relative = os.path.relpath(path)
    shown = path if relative.startswith("..") else relative if os.sep in relative else f".{os.sep}{relative}"
    return shlex.quote(shown)
