"""Care of a ``--save`` directory: one writing job at a time, leftovers of interrupted saves,
and which old checkpoints to keep.

Ownership works without ``flock`` (which some shared filesystems do not honour): the owning job's
rank 0 creates ``owner.json`` with a hard link (atomic on local filesystems and on NFS) holding
its host, pid, process start time, job id and start time, and touches a heartbeat file every
few seconds. Another job that finds the file asks whether the owner still lives: on the same
host by its pid and process start time (a reused pid does not count), on another host by
watching the heartbeat change. A live owner makes the newcomer fail with one line naming it; a
dead owner is taken over, and the log says so. Every save checks that the directory is still
this job's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_h2.checkpointing.format import find_latest_iteration, iteration_dir, saved_iterations
from megatron_h2.errors import ConfigError, TrainingError

OWNER_FILE = "owner.json"
TAKEOVER_FILE = "owner.json.takeover"
HEARTBEAT_S = 5.0
STALE_AFTER_S = 60.0
"""A heartbeat older than this, by the reader's clock, makes an owner on another host suspect;
it is declared dead only if the heartbeat then stays still for two more periods."""


def job_id_from_env() -> str:
    """This job's identity: ``$MEGATRON_H2_JOB_ID`` (stable over elastic restarts), else SLURM's
    job id, else torchrun's run id with its rendezvous address, else this process."""
    env = os.environ
    if env.get("MEGATRON_H2_JOB_ID"):
        return env["MEGATRON_H2_JOB_ID"]
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    if env.get("TORCHELASTIC_RUN_ID"):
        where = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}@{where}"
    return f"process-{socket.gethostname()}-{os.getpid()}"


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_running(pid: int, started: int | None) -> bool:
    """Whether process ``pid`` on this host is alive and is the one that started at ``started``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            return False
    except (OSError, IndexError):
        pass
    return started is None or process_start(pid) in (None, started)


@dataclass(frozen=True)
class OwnerRecord:
    """What ``owner.json`` says about the job that writes to a save directory."""

    host: str
    pid: int
    started: int | None
    job_id: str
    since: float
    token: str

    @classmethod
    def mine(cls, job_id: str) -> OwnerRecord:
        return cls(socket.gethostname(), os.getpid(), process_start(os.getpid()), job_id,
                   time.time(), uuid.uuid4().hex)

    @classmethod
    def parse(cls, text: str) -> OwnerRecord | None:
        try:
            data = json.loads(text)
            record = cls(**data)
        except (ValueError, TypeError):
            return None
        ok = (isinstance(record.host, str) and isinstance(record.pid, int)
              and isinstance(record.job_id, str) and isinstance(record.since, (int, float))
              and isinstance(record.token, str) and re.fullmatch(r"[0-9a-f]{32}", record.token)
              and (record.started is None or isinstance(record.started, int)))
        return record if ok else None

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"host {self.host}, pid {self.pid}, job {self.job_id}, since {since}"


def _heartbeat_path(save_dir: Path, token: str) -> Path:
    return save_dir / f".owner-{token}.heartbeat"


def _read_owner(path: Path) -> tuple[OwnerRecord | None, bool]:
    """(record, exists); an unreadable or malformed file is (None, True)."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None, False
    except OSError:
        return None, True
    return OwnerRecord.parse(text), True


def _beat(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def owner_alive(save_dir: Path, record: OwnerRecord, patience_s: float) -> bool:
    """Same host: the pid and its start time. Another host: a recent heartbeat, or one that
    moves within ``patience_s`` (so clocks that disagree cannot declare a live owner dead)."""
    if record.host == socket.gethostname():
        return pid_running(record.pid, record.started)
    beat = _heartbeat_path(save_dir, record.token)
    first = _beat(beat)
    if first is None:
        return False
    if time.time() - first < STALE_AFTER_S:
        return True
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        time.sleep(min(1.0, patience_s))
        if _beat(beat) != first:
            return True
    return False


def _link_exclusive(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text`` unless it exists; atomic (hard link of a full file)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here: exclusive create (readers retry a half-written file)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        return True
    finally:
        tmp.unlink(missing_ok=True)


class SaveDirOwner:
    """This job's claim on a save directory (held by rank 0 while the job runs)."""

    def __init__(self, save_dir: Path, record: OwnerRecord, heartbeat_s: float) -> None:
        self.save_dir, self.record = save_dir, record
        self.path = save_dir / OWNER_FILE
        self._stop = threading.Event()
        self._beat_path = _heartbeat_path(save_dir, record.token)
        self._beat_path.touch()
        self._thread = threading.Thread(target=self._heartbeat, args=(heartbeat_s,),
                                        name="save-dir-heartbeat", daemon=True)
        self._thread.start()

    def _heartbeat(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                os.utime(self._beat_path)
            except OSError:
                return  # taken over (our heartbeat file was removed): check() will tell

    def check(self) -> None:
        """Raise TrainingError unless ``owner.json`` still names this job."""
        current, _ = _read_owner(self.path)
        if current is None or current.token != self.record.token:
            who = current.describe() if current else "nobody (owner.json is gone)"
            raise TrainingError(f"--save {self.save_dir} no longer belongs to this job (now: "
                                f"{who}); stopping without saving so nothing is overwritten")

    def release(self) -> None:
        """Stop the heartbeat and remove the claim if it is still ours."""
        self._stop.set()
        current, _ = _read_owner(self.path)
        if current is not None and current.token == self.record.token:
            self.path.unlink(missing_ok=True)
        self._beat_path.unlink(missing_ok=True)


def _conflict(save_dir: Path, record: OwnerRecord) -> ConfigError:
    return ConfigError(f"--save {save_dir} is in use by another running job ({record.describe()});"
                       " wait for it to end, stop it, or save to another directory")


def check_owner(save_dir: str | os.PathLike, job_id: str, patience_s: float = 2 * HEARTBEAT_S,
                ) -> None:
    """Fail with one line if a live job other than ``job_id`` owns ``save_dir`` (every rank)."""
    path = Path(save_dir) / OWNER_FILE
    record, _ = _read_owner(path)
    if (record is not None and record.job_id != job_id
            and owner_alive(Path(save_dir), record, patience_s)):
        raise _conflict(Path(save_dir), record)


def acquire_save_dir(save_dir: str | os.PathLike, job_id: str, log,
                     heartbeat_s: float = HEARTBEAT_S, patience_s: float | None = None,
                     ) -> SaveDirOwner:
    """Claim ``save_dir`` for this job (rank 0, before training): take it if free or if its
    owner is dead (said in the log); a live owner is a one-line ConfigError."""
    directory = Path(save_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create --save directory {directory}: "
                          f"{exc.strerror or exc}") from None
    patience = 2 * heartbeat_s if patience_s is None else patience_s
    path = directory / OWNER_FILE
    mine = OwnerRecord.mine(job_id)
    text = json.dumps(asdict(mine))
    for _ in range(50):
        if _link_exclusive(path, text):
            return SaveDirOwner(directory, mine, heartbeat_s)
        current, exists = _read_owner(path)
        if not exists:
            continue  # released meanwhile: try again
        if current is None:  # unreadable / half-written: give a writer a moment, then replace
            if time.time() - (_beat(path) or 0.0) < 5.0:
                time.sleep(0.2)
                continue
        elif owner_alive(directory, current, patience):
            raise _conflict(directory, current)
        if _take_over(directory, current, text):
            what = current.describe() if current else "an unreadable owner.json"
            log(f"took over --save {directory} from a job that is no longer running ({what})")
            return SaveDirOwner(directory, mine, heartbeat_s)
        time.sleep(0.2)
    raise ConfigError(f"could not claim --save {directory}: {OWNER_FILE} keeps changing; is "
                      "another job starting there?")


def _take_over(directory: Path, stale: OwnerRecord | None, text: str) -> bool:
    """Replace a dead owner's record, one taker at a time; False if someone else moved first."""
    lock = directory / TAKEOVER_FILE
    if not _link_exclusive(lock, text):
        if time.time() - (_beat(lock) or time.time()) > 60.0:  # a taker that died midway
            lock.unlink(missing_ok=True)
        return False
    try:
        current, _ = _read_owner(directory / OWNER_FILE)
        if (current is None) != (stale is None) or (current and current.token != stale.token):
            return False
        tmp = directory / f".{OWNER_FILE}.{uuid.uuid4().hex}.tmp"
        tmp.write_text(text)
        os.replace(tmp, directory / OWNER_FILE)
        if stale is not None:
            _heartbeat_path(directory, stale.token).unlink(missing_ok=True)
        return True
    finally:
        lock.unlink(missing_ok=True)


def clean_leftovers(save_dir: str | os.PathLike) -> list[str]:
    """Remove what interrupted saves left behind (``.iter_*.incomplete``, ``iter_*.old``,
    temporary files, heartbeats of former owners); returns the names removed. Rank 0 only,
    after :func:`acquire_save_dir`."""
    directory = Path(save_dir)
    if not directory.is_dir():
        return []
    current, _ = _read_owner(directory / OWNER_FILE)
    mine = f".owner-{current.token}.heartbeat" if current else None
    removed = []
    for entry in sorted(directory.iterdir()):
        name = entry.name
        leftover = (re.fullmatch(r"\.iter_\d+\.incomplete", name)
                    or re.fullmatch(r"iter_\d+\.old", name)
                    or (name.startswith(".") and name.endswith(".tmp"))
                    or re.fullmatch(r"\.latest_checkpointed_iteration\.txt\.tmp-\d+", name)
                    or (name.startswith(".owner-") and name.endswith(".heartbeat")
                        and name != mine))
        if leftover:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(name)
    return removed


def apply_retention(save_dir: str | os.PathLike, retain_interval: int | None,
                    most_recent_k: int = -1, protect: int | None = None) -> list[int]:
    """Delete old checkpoints as Megatron's ``--save-retain-interval`` does: keep the newest,
    every iteration divisible by the interval, and (``most_recent_k`` > 0) the K newest; and
    ``protect`` (the newest verified-good checkpoint, which a stop goes back to). Nothing is
    deleted when neither is set. Returns the iterations removed."""
    if retain_interval is None and most_recent_k < 0:
        return []
    saved = saved_iterations(save_dir)
    keep = set(saved[-max(1, most_recent_k):])
    latest = find_latest_iteration(save_dir)
    keep |= {it for it in (latest, protect) if it is not None}
    if retain_interval:
        keep |= {it for it in saved if it % retain_interval == 0}
    removed = [it for it in saved if it not in keep]
    for it in removed:
        shutil.rmtree(iteration_dir(save_dir, it), ignore_errors=True)
    return removed

