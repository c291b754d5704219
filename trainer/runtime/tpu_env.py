"""The TPU runtime's environment: XLA / libtpu flags and torch-tpu's compilation cache, set before
the first device op; the cache-miss count of a TPU run.

`[device]` flag_bundle, libtpu_init_args, xla_flags; `[compile]` cache_dir, host_cache; the
compilation-cache misses the loop logs (the profiler a `[profiling]` step runs under, TPU
included, is trainer/runtime/profiler.py). None of it has run on a TPU (docs/tpu.md).

When the variables are read (torch-tpu 0.2.0, libtpu 0.0.52; docs/tpu.md, "XLA and libtpu
flags"): `import torch` on a TPU host autoloads torch-tpu and registers the device, but the PJRT
runtime starts at the first device request, and that is when `LIBTPU_INIT_ARGS` and `XLA_FLAGS`
are read (seen on the CPU with a getenv recorder: nothing reads them at import or at device
registration; the first tensor op reads both, then libtpu parses the args and stops the
process on an unknown flag). torch-tpu's C++ reads its own variables once (`GetEnvOnce`); the
compilation-cache ones belong to the compilation cache, which exists only after the runtime
started. So `build_job` applies `tpu_runtime_env` after picking the device and before the
process group (the first device request); a launcher may export the same values instead
(`tpu_runtime_env(...).env`), which also covers tools that touch the device earlier.

On cpu and cuda nothing is set; the settings are reported as not applied.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from models.errors import ConfigError, check_choice

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

FLAGS_FILE = Path(__file__).resolve().parents[2] / "assets" / "tpu_flags.toml"
"""The recorded flag bundles (assets/tpu_flags.toml)."""

TIER3_CACHE_VAR = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
"""torch-tpu's persistent compilation cache: a directory (local or gs://) every process of every
run reads compiled executables from and writes them to (`[compile] cache_dir`)."""
TIER2_CACHE_VAR = "TORCH_TPU_TIER2_COMPILATION_CACHE"
"""torch-tpu's host-local cache: a name under /dev/shm/torch_tpu_cache shared by the processes of
one host, so one of them compiles a program and the others load it. torch-tpu turns it on by
itself in every run of more than one process, under the name 'default' ("Tier-2 compilation cache
is enabled with name 'default' for world size N", and "... 'default' because tier-3 is enabled":
the strings of torch-tpu 0.2.0's C++, docs/tpu.md), and off in a world of 1 ("Tier-2 compilation
cache is disabled for world size 1"). So `[compile] host_cache` only names it (titan-tpu)."""
HOST_CACHE_NAME = "titan-tpu"
"""The tier-2 cache name (entries are keyed by torch-tpu's binary fingerprint and the program)."""

CACHE_MISS_LINE = "titan-tpu: compile cache misses at step"
"""The start of the console line the loop prints on a TPU after a step that missed torch-tpu's
compilation cache: `titan-tpu: compile cache misses at step N: +K (total T)`."""

_FLAG = re.compile(r"^--([A-Za-z0-9_][A-Za-z0-9_.-]*)(=.*)?$")


@dataclass(frozen=True)
class FlagBundle:
    """One recorded bundle of assets/tpu_flags.toml."""

    name: str
    generations: tuple[str, ...]
    libtpu_init_args: tuple[str, ...]
    xla_flags: tuple[str, ...]
    sources: Mapping[str, str]
    """Flag name -> where it comes from (the text of assets/tpu_flags.toml's [sources] entry)."""


def load_bundles(path: Path = FLAGS_FILE) -> dict[str, FlagBundle]:
    """The bundles of `path` by name; AssertionError if one is malformed (a shipped file)."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    sources = data.get("sources", {})
    bundles = {}
    for name, raw in data.get("bundle", {}).items():
        flags = [*raw.get("libtpu_init_args", []), *raw.get("xla_flags", [])]
        for flag in flags:
            key = flag_name(flag)
            assert key is not None, f"{path}: bundle {name}: {flag!r} is not --name[=value]"
            assert raw.get("sources", {}).get(key) in sources, f"{path}: bundle {name}: {key} has no source"
        bundles[name] = FlagBundle(
            name=name,
            generations=tuple(raw["generations"]),
            libtpu_init_args=tuple(raw.get("libtpu_init_args", [])),
            xla_flags=tuple(raw.get("xla_flags", [])),
            sources={k: " ".join(sources[v].split()) for k, v in raw.get("sources", {}).items()},
        )
    return bundles


def flag_name(flag: str) -> str | None:
    """The name of a `--name[=value]` flag, or None when `flag` is not one."""
    match = _FLAG.match(flag)
    return match.group(1) if match else None


BUNDLES = load_bundles()
FLAG_BUNDLES = ("auto", "none", *BUNDLES)
"""`[device] flag_bundle` choices: auto (the host generation's bundle), none, or a bundle's name."""


def check_flags(key: str, flags: Iterable) -> list[str]:
    """`flags` as strings, each `--name` or `--name=value`; ConfigError naming `key` otherwise."""
    out = []
    for flag in flags:
        if not isinstance(flag, str) or flag_name(flag) is None:
            raise ConfigError(f'{key}: {flag!r} is not a flag; allowed: a list of "--name=value" or "--name" strings')
        out.append(flag)
    return out


def merge_flags(*layers: Iterable[str]) -> list[str]:
    """The flags of every layer, a later layer's value winning for the same flag name; order of
    first appearance. Tokens that are not `--name` flags (kept from an exported variable) are
    kept once, as they are."""
    merged: dict[str, str] = {}
    for layer in layers:
        for flag in layer:
            merged[flag_name(flag) or flag] = flag
    return list(merged.values())


def known_flag_names(names: Iterable[str], libraries: Iterable[Path]) -> set[str]:
    """The subset of `names` that occurs as a C string (the name then a NUL byte) in one of
    `libraries` (libtpu.so; torch-tpu's libxla_base.so): how libtpu's flag table stores them.
    A name that is only the tail of a longer string counts as known (a linker may share tails),
    so the check can miss a typo but never refuses a real flag."""
    import mmap

    wanted = {n: n.encode() + b"\0" for n in names}
    found: set[str] = set()
    for lib in libraries:
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            found.update(n for n, needle in wanted.items() if n not in found and m.find(needle) >= 0)
    return found


def runtime_libraries() -> list[Path]:
    """libtpu.so and torch-tpu's libxla_base.so where installed (never imports either)."""
    import importlib.util

    out = []
    for package, rel in (("libtpu", "libtpu.so"), ("torch_tpu", "csrc/common/libxla_base.so")):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            path = Path(list(spec.submodule_search_locations)[0]) / rel
            if path.is_file():
                out.append(path)
    return out


@dataclass
class RuntimeEnv:
    """The environment a TPU run sets before its first device op, and what to tell the user."""

    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """One banner line each (`titan-tpu: ...`)."""

    def apply(self, environ: os._Environ | dict | None = None) -> None:
        (os.environ if environ is None else environ).update(self.env)


def tpu_runtime_env(
    *,
    device_type: str,
    generation: str | None,
    flag_bundle: str = "auto",
    libtpu_init_args: Iterable[str] = (),
    xla_flags: Iterable[str] = (),
    cache_dir: str = "",
    host_cache: bool = False,
    environ: Mapping[str, str] | None = None,
    libraries: Iterable[Path] | None = None,
) -> RuntimeEnv:
    """The variables a run on `device_type` sets (`[device]` flags, `[compile]` cache), merged
    with what `environ` (default os.environ) already exports.

    Flags, lowest precedence first: the bundle (`flag_bundle`: auto = the bundle named after
    `generation`, none, or a bundle's name, which must be recorded for `generation`), the
    recipe's `libtpu_init_args` / `xla_flags`, then the flags already exported in
    LIBTPU_INIT_ARGS / XLA_FLAGS (a shell's `LIBTPU_INIT_ARGS=... scripts/train.sh` is the
    quickest way to try one flag, so it wins). Each flag name is looked up in `libraries`
    (default: the installed libtpu.so and torch-tpu's libxla_base.so; none installed: no check):
    libtpu stops the process on an unknown flag, this names it first (ConfigError).
    `cache_dir` (a path, made absolute, or gs://...) and `host_cache` set torch-tpu's tier-3 and
    tier-2 compilation caches; an exported value is kept when the key is unset. The banner line
    says which tiers are on: tier 2 is torch-tpu's default in a world of more than one process
    (`WORLD_SIZE` in `environ`, torchrun's), named or not (`TIER2_CACHE_VAR`).
    """
    environ = os.environ if environ is None else environ
    libtpu_args = check_flags("device.libtpu_init_args", libtpu_init_args)
    xla = check_flags("device.xla_flags", xla_flags)
    check_choice("device.flag_bundle", flag_bundle, FLAG_BUNDLES)
    out = RuntimeEnv()
    if device_type != "tpu":
        asked = {
            "flag_bundle": flag_bundle not in ("auto", "none"),
            "libtpu_init_args": libtpu_args,
            "xla_flags": xla,
            "cache_dir": cache_dir,
            "host_cache": host_cache,
        }
        out.notes.extend(_not_applied(device_type, asked))
        return out

    bundle = pick_bundle(flag_bundle, generation)
    merged_libtpu, merged_xla = _merged_flags(
        bundle, libtpu_args=libtpu_args, xla=xla, environ=environ, libraries=libraries
    )
    if merged_libtpu:
        out.env["LIBTPU_INIT_ARGS"] = " ".join(merged_libtpu)
    if merged_xla:
        out.env["XLA_FLAGS"] = " ".join(merged_xla)
    out.notes.append(_flags_note(out.env, bundle=bundle, flag_bundle=flag_bundle, generation=generation))

    out.env.update(_cache_vars(cache_dir=cache_dir, host_cache=host_cache))
    out.notes.append(f"titan-tpu: compilation cache: {cache_tiers(out.env, environ)}")
    return out


def _cache_vars(*, cache_dir: str, host_cache: bool) -> dict[str, str]:
    """torch-tpu's tier-3 (`cache_dir`, made absolute unless gs://) and tier-2 (`host_cache`) cache variables."""
    out = {}
    if cache_dir:
        out[TIER3_CACHE_VAR] = (
            cache_dir if cache_dir.startswith("gs://") else os.path.abspath(os.path.expanduser(cache_dir))
        )
    if host_cache:
        out[TIER2_CACHE_VAR] = HOST_CACHE_NAME
    return out


def _not_applied(device_type: str, asked: Mapping[str, object]) -> list[str]:
    """Off TPU: a note naming the TPU-only settings set (truthy in `asked`), or none."""
    names = [k for k, v in asked.items() if v]
    return [f"titan-tpu: {', '.join(names)} not applied on {device_type} (TPU only)"] if names else []


def _merged_flags(
    bundle: FlagBundle | None,
    *,
    libtpu_args: list[str],
    xla: list[str],
    environ: Mapping[str, str],
    libraries: Iterable[Path] | None,
) -> tuple[list[str], list[str]]:
    """(LIBTPU_INIT_ARGS, XLA_FLAGS) flags: the bundle's, then the recipe's, then the exported ones
    (later wins); every flag name looked up in `libraries` (ConfigError naming where it came from)."""
    env_libtpu = shlex.split(environ.get("LIBTPU_INIT_ARGS", ""))
    env_xla = shlex.split(environ.get("XLA_FLAGS", ""))
    merged_libtpu = merge_flags(bundle.libtpu_init_args if bundle else (), libtpu_args, env_libtpu)
    merged_xla = merge_flags(bundle.xla_flags if bundle else (), xla, env_xla)
    _check_known(
        [
            (f, "device.libtpu_init_args" if f in libtpu_args else "LIBTPU_INIT_ARGS (bundle or environment)")
            for f in merged_libtpu
        ]
        + [(f, "device.xla_flags" if f in xla else "XLA_FLAGS (bundle or environment)") for f in merged_xla],
        runtime_libraries() if libraries is None else list(libraries),
    )
    return merged_libtpu, merged_xla


def _flags_note(env: Mapping[str, str], *, bundle: FlagBundle | None, flag_bundle: str, generation: str | None) -> str:
    """The banner line saying which bundle (or why none) and the flag variables the run sets."""
    if bundle is not None:
        which = f"bundle {bundle.name}"
    elif flag_bundle == "none":
        which = "no bundle (flag_bundle = none)"
    else:
        which = f"no bundle (none recorded for {generation or 'an unknown TPU generation'})"
    return (
        f"titan-tpu: flags: {which}; LIBTPU_INIT_ARGS={env.get('LIBTPU_INIT_ARGS', '')!r} "
        f"XLA_FLAGS={env.get('XLA_FLAGS', '')!r}"
    )


def cache_tiers(env: Mapping[str, str], environ: Mapping[str, str]) -> str:
    """Which of torch-tpu's compilation cache tiers are on, in words (the banner's line): tier 1 in
    memory always; tier 2 (the host's /dev/shm) named by `TIER2_CACHE_VAR` or torch-tpu's default
    'default' in a world of more than one process (`WORLD_SIZE`), off in a world of 1; tier 3 where
    `TIER3_CACHE_VAR` points."""
    value = lambda var: env.get(var) or environ.get(var)  # noqa: E731
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    tier2 = value(TIER2_CACHE_VAR)
    if tier2:
        host = f"tier 2 host cache on ({TIER2_CACHE_VAR}={tier2})"
    elif world > 1:
        host = f"tier 2 host cache on (torch-tpu's default for {world} processes, name 'default')"
    else:
        host = "tier 2 host cache off (torch-tpu turns it off in a world of 1)"
    tier3 = value(TIER3_CACHE_VAR)
    persistent = f"tier 3 persistent cache on ({TIER3_CACHE_VAR}={tier3})" if tier3 else "tier 3 off"
    return f"tier 1 in memory; {host}; {persistent}"


def pick_bundle(flag_bundle: str, generation: str | None) -> FlagBundle | None:
    """The bundle `flag_bundle` names for `generation` (auto: the generation's own, if recorded; none:
    None); ConfigError for a bundle recorded for other generations."""
    if flag_bundle == "none":
        return None
    if flag_bundle == "auto":  # the bundle named after the generation, if one is recorded
        return BUNDLES.get(generation) if generation is not None else None
    bundle = BUNDLES[flag_bundle]
    if generation not in bundle.generations:
        here = [n for n, b in BUNDLES.items() if generation in b.generations]
        raise ConfigError(
            f"device.flag_bundle: {flag_bundle!r} is recorded for {', '.join(bundle.generations)}, and this "
            f"host is {generation or 'an unknown TPU generation'}; allowed here: "
            f"{', '.join(['auto', 'none', *here])}"
        )
    return bundle


def _check_known(flags: list[tuple[str, str]], libraries: list[Path]) -> None:
    """ConfigError naming the flag's key (device.libtpu_init_args, device.xla_flags or the exported
    variable) for a flag name the installed runtime's `libraries` do not hold."""
    if not libraries:
        return
    names = {flag_name(f): (f, key) for f, key in flags if flag_name(f)}
    known = known_flag_names(names, libraries)
    for name, (flag, key) in names.items():
        if name not in known:
            raise ConfigError(
                f"{key}: {flag!r} is not a flag of the installed TPU runtime "
                f"({', '.join(str(p) for p in libraries)}); libtpu would stop the process on it. "
                "allowed: flags libtpu knows (check the name)"
            )


def detect_generation() -> str | None:
    """The local TPU generation (v4 | v5e | v5p | v6e | v7x) from torch-tpu, the accelerator-type
    variables or the PCI ids (`trainer.runtime.flops`); None when none says."""
    from trainer.runtime.flops import _tpu_kind_candidates, tpu_generation

    for kind in _tpu_kind_candidates():
        generation = tpu_generation(kind)
        if generation is not None:
            return generation
    return None


# ----------------------------------------------------------------------------- compilation cache


def compile_cache_misses(device_type: str, tpu_module=None) -> int | None:
    """torch-tpu's count of compilation cache misses in this process (every program it had to
    compile: eager ops and compiled graphs), or None off a TPU or when torch-tpu cannot say.
    A host-side counter: reading it does not wait for the device."""
    if device_type != "tpu":
        return None
    if tpu_module is None:
        import torch

        tpu_module = getattr(torch, "tpu", None)
    try:
        return int(tpu_module._get_cache_misses())
    except Exception:  # not initialised, or a torch-tpu without the counter
        return None


def compilations(device_type: str, tpu_module=None) -> int | None:
    """How many programs torch-tpu compiled in this process (`torch.tpu._get_cache_stats()`'s
    `num_compilations`), or None off a TPU or when torch-tpu cannot say. Beside the miss count
    because a program missing the in-memory cache may be loaded from the host or persistent
    cache instead of compiled; whether torch-tpu 0.2.0 counts such a load as a miss is not
    known (docs/tpu.md, "Compile cache"), this count tells them apart."""
    if device_type != "tpu":
        return None
    if tpu_module is None:
        import torch

        tpu_module = getattr(torch, "tpu", None)
    try:
        return int(tpu_module._get_cache_stats().num_compilations)
    except Exception:  # not initialised, or a torch-tpu without the stats
        return None


class CacheMissCounter:
    """Per-step compilation cache misses on a TPU: `step_done(step)` after each step returns the
    console line to print when the count grew (the loop prints it on rank 0), and `total` is the
    count to log in metrics.jsonl (`compile_cache_misses`); `compiled()` the programs compiled so
    far (`compilations`, read on logged steps only). On other devices all stay None."""

    def __init__(
        self,
        device_type: str,
        read: Callable[[], int | None] | None = None,
        read_compiled: Callable[[], int | None] | None = None,
    ):
        self._read = read if read is not None else (lambda: compile_cache_misses(device_type))
        self.compiled = read_compiled if read_compiled is not None else (lambda: compilations(device_type))
        self.total = self._read()

    def step_done(self, step: int) -> str | None:
        if self.total is None:
            return None
        now = self._read()
        if now is None:
            return None
        before, self.total = self.total, now
        if now > before:
            return f"{CACHE_MISS_LINE} {step}: +{now - before} (total {now})"
        return None
