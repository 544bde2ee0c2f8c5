"""The tools' settings: the sandbox's limits and the executor's concurrency."""

from __future__ import annotations

from dataclasses import dataclass, fields

ISOLATIONS = ("auto", "namespaces", "audit")


@dataclass(frozen=True)
class ToolsConfig:
    names: tuple[str, ...] = ("python", "calculator")  # the tools offered to the model (TOOLS names)
    max_concurrency: int = 8  # sandboxes running at once (and executor threads)
    timeout_s: float = 10.0  # wall clock per call; then the sandbox is killed
    cpu_s: int = 10  # CPU seconds per program (RLIMIT_CPU)
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    max_processes: int = 32  # processes of the sandbox's user (RLIMIT_NPROC)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_file_mb: int = 16  # largest file a program may write (RLIMIT_FSIZE)
    scratch_mb: int = 64  # the scratch folder's size (namespaces: a tmpfs)
    scratch_files: int = 4096  # files and folders in it (namespaces)
    output_bytes: int = 8192  # stdout + stderr read; a program printing more is stopped there
    max_code_bytes: int = 256 * 1024  # longest program accepted
    # "namespaces": own mount, network, pid, ipc and uts namespaces (with a user namespace when not
    # root); "audit": an audit hook only (weaker, see sandbox.py); "auto": namespaces where the
    # machine allows them, else audit.
    isolation: str = "auto"
    # As root: the first of max_concurrency uids the programs run as (one per running sandbox, so
    # RLIMIT_NPROC counts one sandbox's processes); no account may use them.
    sandbox_uid: int = 61000
    scratch_root: str = ""  # audit isolation: where scratch folders go ("" = the temp folder)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float") and not value > 0:
                raise ValueError(f"tools.{f.name}={value} must be > 0")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"tools.isolation={self.isolation!r} must be one of {', '.join(ISOLATIONS)}")
