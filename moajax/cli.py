"""The ``moajax`` command line: ``moajax derive [--list | KERNEL [--adjoint | --saved | --tangent]]``, ``moajax gpu-report``,
``moajax measure [--out PATH]``, ``moajax validate [--out DIR] [--full] [--kernels …] [--machine NAME]``."""

from __future__ import annotations

import argparse
import re
import sys


def _kernels():
    import moajax.kernels  # noqa: F401 - registers the seed kernels
    from moajax.kernel import REGISTRY

    return REGISTRY


def cmd_derive(args) -> int:
    reg = _kernels()
    if args.list or not args.kernel:
        width = max(len(n) for n in reg)
        for name, k in reg.items():
            doc = (k.fn.__doc__ or "").strip().splitlines()[0]
            sig = ", ".join(f"{p.name}[{' '.join(p.dims)}]" for p in k.params)
            print(f"{name:<{width}}  ({sig})  {doc}")
        return 0
    names = list(reg) if args.kernel == ["all"] else args.kernel
    for name in names:
        if name not in reg:
            print(f"moajax derive: unknown kernel {name!r}; known: {', '.join(reg)}", file=sys.stderr)
            return 2
        if args.tangent and (args.adjoint or args.saved):
            print("moajax derive: --tangent and --adjoint/--saved exclude each other", file=sys.stderr)
            return 2
        k = (reg[name].adjoint(saved=args.saved) if args.adjoint or args.saved
             else reg[name].tangent() if args.tangent else reg[name])
        print(f"== {k.name}: example sizes {k.example}")
        print(k.dnf().pretty())
        print()
        der = k.derivation()
        print(der.pretty(max_steps=None if args.full else 60))
        identities = [st for st in der.steps if not st.rule.startswith("ψ")]
        if identities:  # the rewrites after ψ-reduction (moajax.identities), never cut off
            print("identities applied to the DNF:")
            for st in identities:
                print(f"  [{st.rule}] {st.before}  ⇒  {st.after}")
        print()
    return 0


def cmd_gpu_report(args) -> int:
    import os

    try:  # (a case's label, before its kernels' names: "grad MHA causal adjoint float32 H=64")
        only = None if args.only is None else re.compile(args.only).search
    except re.error as e:
        print(f"moajax gpu-report: --only is not a regular expression: {e}", file=sys.stderr)
        return 2

    # an offline compile needs no GPU backend: where the CUDA plugin is installed but no CUDA
    # runtime is (a login node, a CPU host), starting its backend fails and its Triton
    # compilation handler is never registered ("no CUDA Triton compilation handler")
    import jax

    if not os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")  # (read from the environment when jax was imported)

    jax.config.update("jax_enable_x64", True)  # float64 kernels are compiled as float64
    from moajax import compat, gpu_report, ptx, schedule

    reason = ptx.toolchain_missing()
    if reason:
        print(f"moajax gpu-report: cannot compile offline: {reason}", file=sys.stderr)
        return 2
    archs = sorted({m.arch for m in gpu_report.gpus()})
    unknown = [a for a in args.arch if a not in archs]
    if unknown:  # (a typo such as sm_90 for sm_90a matched no profile and reported 0 kernels)
        print(f"moajax gpu-report: no GPU profile has arch {', '.join(unknown)}; the profiles' archs are "
              f"{', '.join(archs)}", file=sys.stderr)
        return 2
    if args.out and not _writable_file(args.out, "gpu-report"):
        return 2
    # derived with each GPU's spill check on (gpu_report.gpus): the tilings a GPU runs
    targets = gpu_report.gpus(tuple(args.arch or ()))
    two_bytes = tuple(d for d in ("bfloat16", "float32") if d in args.dtypes)
    cases = gpu_report.default_cases(tuple(args.head_dims), tuple(args.dtypes), targets=targets, only=only)
    cases += gpu_report.backward_cases(tuple(h for h in args.head_dims if h in (64, 128)) or (64,),
                                       tuple(args.dtypes), targets=targets, only=only)
    for family in (gpu_report.model_cases, gpu_report.training_cases, gpu_report.tangent_cases,
                   gpu_report.model_training_cases):
        cases += family(two_bytes, targets=targets, only=only)
    cases += gpu_report.score_mod_cases(tuple(d for d in ("float32",) if d in args.dtypes), targets=targets, only=only)
    reg = _kernels()
    for name in ("attention", "decode", "rmsnorm", "swiglu", "block"):
        label = f"{name} float32 (example sizes)"
        for m in targets if gpu_report.wanted(only, label) else ():
            cases.append((label, m, schedule.derive(reg[name].dnf(), m)))
    header = ("| machine | arch | kernel | tiles (rows×keys) | warps | stages | smem B (ptxas) | smem B (model) "
              "| smem limit B | registers | spill st/ld B | atomics | wgmma / mma.sync | ok |")
    lines = [header, "|" + "---|" * 14]
    rows, bad = report_rows(cases, args.arch)
    lines += rows
    paths = _two_paths(args, gpu_report, only)
    if args.out:
        import datetime
        from pathlib import Path

        head = [
            "# Offline GPU report: default ONFs compiled to PTX (no GPU used)",
            "",
            f"Date {datetime.date.today().isoformat()}; JAX {jax.__version__}; `moajax gpu-report` lowers each kernel "
            "for CUDA, compiles its Triton IR with jaxlib's Triton compiler for the machine's arch and runs "
            f"`ptxas -v` (ptxas {ptx.ptxas_version()}). smem (model) is the cost model's estimate used to reject ONFs. "
            "Each ONF is derived with its profile's spill check on (`Machine.spill_check`): the first table tiling "
            "that fits shared memory and that ptxas compiles without spilling. wgmma / mma.sync: the tensor-core "
            "instructions in the PTX (static counts; Hopper's warpgroup wgmma, and mma.sync, Ampere's and sm_90a's "
            "fallback for a dot wgmma cannot take: fewer than 64 rows). Float32 dots: "
            f"{'IEEE float32' if compat.default_dot_precision() == 'highest' else 'TF32'} "
            f"(jax.default_matmul_precision: {compat.matmul_precision_config() or 'JAX default'}).",
            "",
        ]
        Path(args.out).write_text("\n".join(head + lines + paths) + "\n")
    print(f"{len(lines) - 2} kernels, {bad} with spills, shared-memory overflow or failures")
    return 1 if bad else 0


def _tiles_text(onf) -> str:
    """An ONF's tiles as the report prints them: its tiled grid and sequential axes, in order."""
    return "×".join(str(a.tile) for a in onf.axes if a.role in ("grid", "sequential") and a.tile > 1) or "1"


def report_rows(cases, archs=()) -> tuple:
    """The gpu-report's table rows for (label, machine, ONF) cases (only ``archs`` if given),
    one per compiled kernel, and how many are not clean (spills, shared-memory overflow,
    failures)."""
    from moajax import ptx
    from moajax.cost import onchip_bytes

    lines: list = []
    bad = 0
    for label, m, onf in cases:
        if archs and m.arch not in archs:
            continue
        try:
            if isinstance(onf, Exception):
                raise onf
            reports = ptx.onf_reports(onf, m.arch)
        except Exception as e:  # a failure is a finding: report it, do not hide it
            bad += 1
            lines.append(f"| {m.name} | {m.arch} | {label} | — | — | — | — | — | — | — | — | — | — | FAILED: {str(e)[:120]} |")
            print(lines[-1], flush=True)
            continue
        tiles = _tiles_text(onf)
        # one row per kernel of a multi-kernel ONF (memory stages, split-K partials and combine,
        # the backward's scatter-add kernels): each is compiled, each must be free of spills
        distinct = len({r.kernel for r in reports}) == len(reports)
        for i, r in enumerate(reports):
            name = (label if len(reports) == 1 else f"{label} {r.kernel.removeprefix('moajax_')}" if distinct
                    else f"{label} kernel {i + 1}/{len(reports)}")
            ok = r.spill_stores == 0 and r.spill_loads == 0 and r.smem_bytes <= m.shared_memory_per_block
            bad += not ok
            lines.append(
                f"| {m.name} | {m.arch} | {name} | {tiles} | {onf.knobs.num_warps} | {onf.knobs.num_stages} | "
                f"{r.smem_bytes} | {onchip_bytes(onf)} | {m.shared_memory_per_block} | {r.registers} | "
                f"{r.spill_stores}/{r.spill_loads} | {r.atomics} | {r.wgmma} / {r.mma_sync} | {'yes' if ok else 'NO'} |"
            )
            print(lines[-1], flush=True)
    return lines, bad


def _two_paths(args, gpu_report, only=None) -> list:
    """The attention ONFs through both GPU paths, side by side: the Pallas kernel (jaxlib's
    Triton) and the ONF's generated Triton source (Triton's own compiler, jax-triton's path).
    Empty without Triton installed (the ``test`` extra brings it)."""
    try:
        from pallas_kernels import triton_source

        if triton_source.ptxas() is None:
            raise ImportError("no ptxas in the triton wheel")
    except ImportError as e:
        print(f"moajax gpu-report: the jax-triton path is not compared: {e}", file=sys.stderr)
        return []
    import triton

    from moajax import ptx

    import dataclasses

    def attention_cases(targets):
        cases = gpu_report.default_cases((64,), ("float32",), targets=targets, only=only)
        cases += gpu_report.training_cases(("float32",), targets=targets,
                                           only=lambda label: "GQA" not in label and gpu_report.wanted(only, label))
        return cases + gpu_report.backward_cases((64,), ("float32",), targets=targets, only=only)

    targets = gpu_report.gpus(tuple(args.arch or ()))
    # what implementation="triton" runs: the ONF its spill check derives through the source
    own = {(label, m.name): onf for label, m, onf in
           attention_cases([dataclasses.replace(m, gpu_path="triton") for m in targets])}
    lines = ["", "## The two GPU paths for the same ONF", "",
             f"Pallas (jaxlib's Triton, ptxas {ptx.ptxas_version()}) against the ONF's generated Triton source "
             f"(`pallas_kernels.triton_source`, Triton {triton.__version__} and its ptxas; launched by jax-triton). "
             "Per kernel: shared memory B, registers, spill stores/loads B, atomics. The ONF is the one Pallas runs "
             "(spill-checked through Pallas). The last two columns: the ONF `implementation=\"triton\"` runs, "
             "spill-checked through the source (`Machine.gpu_path`), where its tiling differs (tiles as above, "
             "warps, stages), and its spill stores/loads B through the source.", "",
             "| machine | arch | kernel | Pallas smem | Pallas regs | Pallas spills | Pallas atomics | Triton smem | "
             "Triton regs | Triton spills | Triton atomics | Triton path's ONF | its Triton spills |", "|" + "---|" * 13]
    for label, m, onf in attention_cases(targets):
        if (args.arch and m.arch not in args.arch) or isinstance(onf, Exception):
            continue
        try:
            pairs = list(zip(ptx.onf_reports(onf, m.arch), ptx.triton_source_reports(onf, m.arch)))
            mine = own.get((label, m.name))
            same = mine == onf
            theirs = [] if same or isinstance(mine, Exception) else ptx.triton_source_reports(mine, m.arch)
            for i, (a, b) in enumerate(pairs):
                if same:
                    alt = "same | —"
                elif isinstance(mine, Exception):
                    alt = f"FAILED: {str(mine)[:80]} | —"
                else:
                    c = theirs[i] if i < len(theirs) else None
                    alt = (f"{_tiles_text(mine)}, {mine.knobs.num_warps} warps, {mine.knobs.num_stages} stages | "
                           + ("—" if c is None else f"{c.spill_stores}/{c.spill_loads}"))
                lines.append(f"| {m.name} | {m.arch} | {label} {a.kernel.removeprefix('moajax_')} | {a.smem_bytes} | "
                             f"{a.registers} | {a.spill_stores}/{a.spill_loads} | {a.atomics} | {b.smem_bytes} | "
                             f"{b.registers} | {b.spill_stores}/{b.spill_loads} | {b.atomics} | {alt} |")
                print(lines[-1], flush=True)
        except Exception as e:  # a failure is a finding
            lines.append(f"| {m.name} | {m.arch} | {label} | FAILED: {str(e)[:120]} |" + " |" * 9)
            print(lines[-1], flush=True)
    return lines


def cmd_measure(args) -> int:
    import dataclasses
    from pathlib import Path

    from moajax import machines, measure

    if args.out and not _writable_file(args.out, "measure"):
        return 2
    m = measure.measure(gemm_n=512, copy_mb=64, tune_seq=256) if args.quick else measure.measure()
    text = measure.to_toml(dataclasses.replace(m, name=args.name))
    out = Path(args.out) if args.out else machines.cache_dir() / "local.toml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"moajax measure: wrote {out}")
    return 0


def cmd_validate(args) -> int:
    from pathlib import Path

    from absl import logging

    from moajax import machines, validate

    import os

    if Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"moajax validate: --out {args.out} is a file; it names the folder for validation.md and the plots",
              file=sys.stderr)
        return 2
    try:
        kernels = validate.check_kernels(args.kernels)
        if args.machine:
            machine = machines.load(args.machine)
        elif os.environ.get("MOAJAX_MACHINE"):
            machines.local()  # a bad MOAJAX_MACHINE is named now, not after the kernels are built
    except (ValueError, KeyError) as e:
        print(f"moajax validate: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    logging.set_verbosity(logging.INFO)
    logging.use_absl_handler()
    if not args.machine:
        cached = machines.cache_dir() / "local.toml"
        if not os.environ.get("MOAJAX_MACHINE") and not cached.is_file():
            # α and β are this machine's: measure it once (``moajax measure``), then predict with it
            import dataclasses

            from moajax import measure

            logging.info("validate: no measured profile of this machine; measuring it (moajax measure) into %s",
                         cached)
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(measure.to_toml(dataclasses.replace(measure.measure(gemm_n=1024, copy_mb=256),
                                                                  name="local")))
            machines.local.cache_clear()
        machine = machines.local()

    def progress(i, total, text):  # absl logging, as JAX's own tools report long runs
        logging.info("validate [%d/%d] %s", i, total, text)

    try:
        rows = validate.run(kernels, full=args.full, machine=machine, reps=args.reps, progress=progress)
    except ValueError as e:
        print(f"moajax validate: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = validate.report(rows, machine, full=args.full)
    (out / "validation.md").write_text("\n".join(lines) + "\n")
    plots = validate.plot(rows, out)
    print("\n".join(lines))
    print(f"moajax validate: wrote {out / 'validation.md'}" + "".join(f", {p}" for p in plots)
          + ("" if plots else " (no plots: install the 'plot' extra for matplotlib)"))
    return 0


def _writable_file(path: str, who: str) -> bool:
    """Can ``path`` be written as a file (checked before a long run, not after it)? Makes its folder."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        print(f"moajax {who}: --out {path} is a folder; give a file name", file=sys.stderr)
        return False
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"moajax {who}: cannot write --out {path}: {e}", file=sys.stderr)
        return False
    return True


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not a positive integer")
    return n


GPU_REPORT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moajax", description="Mathematics of Arrays kernels for JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("derive", help="print a kernel's DNF and its ψ-reduction")
    d.add_argument("kernel", nargs="*", help="kernel name(s), or 'all'")
    d.add_argument("--list", action="store_true", help="list the kernels")
    d.add_argument("--full", action="store_true", help="print every derivation step")
    d.add_argument("--adjoint", action="store_true",
                   help="the kernel's backward, derived in the algebra (moajax.adjoint): its DNF and derivation")
    d.add_argument("--tangent", action="store_true",
                   help="the kernel's forward-mode derivative, derived in the algebra (moajax.tangent): what "
                        "jax.jvp runs")
    d.add_argument("--saved", action="store_true",
                   help="the adjoint that reads the forward's row statistics and outputs (what jax.grad runs "
                        "where saving pays), with the papers' identities (moajax.identities) in its derivation")
    d.set_defaults(func=cmd_derive)
    g = sub.add_parser("gpu-report", help="compile each kernel's default GPU ONF (derived with the spill check, "
                                          "as on a GPU) to PTX offline; print resources")
    g.add_argument("--arch", nargs="*", default=[], help="only these archs (sm_80 sm_86 sm_90a)")
    g.add_argument("--head-dims", nargs="*", type=_positive_int, default=[64, 72, 128])
    g.add_argument("--dtypes", nargs="*", choices=GPU_REPORT_DTYPES, default=list(GPU_REPORT_DTYPES))
    g.add_argument("--out", default="", help="also write the table (markdown) here")
    g.add_argument("--only", default=None, metavar="REGEX",
                   help="only the cases whose label this regular expression matches (re.search), e.g. "
                        "'grad MHA causal' or '^mha bfloat16'; the others are neither derived nor compiled")
    g.set_defaults(func=cmd_gpu_report)
    m = sub.add_parser("measure", help="time this machine's peak rates and bandwidth; write its profile")
    m.add_argument("--out", default="", help="write the profile here (default: the cache that machines.local() reads)")
    m.add_argument("--quick", action="store_true", help="small sizes (512² matmul, 64 MiB scale): a fast sanity run")
    m.add_argument("--name", default="local", help="the profile's name")
    m.set_defaults(func=cmd_measure)
    v = sub.add_parser("validate", help="the main job: each seed kernel verified in float64, timed, and its time "
                                        "predicted by the cost model (validation.md and plots)")
    v.add_argument("--out", default="validation", help="the folder for validation.md and the PNG plots")
    v.add_argument("--full", action="store_true", help="the seed's sizes (long); default: quick sizes")
    v.add_argument("--kernels", nargs="*", default=[], help="only these kernels (default: all)")
    v.add_argument("--machine", default="", help="the machine profile to predict with (default: this machine's)")
    v.add_argument("--reps", type=_positive_int, default=3, help="timed runs per size (median)")
    v.set_defaults(func=cmd_validate)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
