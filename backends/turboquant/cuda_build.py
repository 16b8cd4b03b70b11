"""Building TurboQuant's CUDA extensions (the decode, the write) with the machine's nvcc on
first use, and the one log line a failed build leaves."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["build_or_report", "load_extension"]


def load_extension(source: Path, prefix: str, flags: list[str]):
    """``source`` built with nvcc under ``flags`` (torch's ``cpp_extension.load``). The build's
    name is ``prefix`` and a hash of the source and the flags: torch's extension cache
    (``TORCH_EXTENSIONS_DIR``) keeps builds by name, so one copied from another machine or
    left by an older checkout is reused only for the same source."""
    from torch.utils.cpp_extension import load

    digest = hashlib.sha1(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    return load(name=f"{prefix}_{digest}", sources=[str(source)], extra_cuda_cflags=flags,
                verbose=False)


def build_or_report(build, what: str, fallback: str, flag: str) -> bool:
    """Whether ``build()`` succeeds (nvcc and ninja on the machine; about a minute the first
    time, cached by torch after). A failure is logged once with its reason: ``what`` did not
    build, ``fallback`` serves instead, tuning ``flag=false`` skips the build."""
    import logging

    log = logging.getLogger("attn_ops")
    log.info("%s: loading its extension (built with nvcc on a machine's first use, about a "
             "minute; torch caches it)", what)
    try:
        build()
        return True
    except Exception as e:  # noqa: BLE001 -- any build failure: the fallback serves
        log.warning("%s did not build (%s: %s); %s. Set tuning %s=false to skip the build.",
                    what, type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "",
                    fallback, flag)
        return False
