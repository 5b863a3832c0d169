"""Download vLLM's source distribution (for its example P/D proxy) through pip's own index settings.

    python3 benchmarks/peers/fetch_vllm_sdist.py 0.32.0 DEST_DIR     # prints DEST_DIR/vllm-0.32.0.tar.gz

`pip download --no-binary :all: vllm==0.32.0` fails: it builds the sdist's metadata (CUDA
toolchain). This asks pip's PackageFinder for the same file and downloads it with pip's
session (same index, proxies and certificates as `pip install`), without building anything.
Uses pip internals (checked with pip 23.2): a benchmark helper, not part of pdclient.
"""

import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet
from pip._internal.commands import create_command

version, dest = sys.argv[1], Path(sys.argv[2])
command = create_command("download")
options, _ = command.parse_args(["--no-deps", "--no-binary", ":all:", f"vllm=={version}"])
with command.main_context():
    session = command.get_default_session(options)
finder = command._build_package_finder(
    options=options, session=session, target_python=None, ignore_requires_python=True
)
best = finder.find_best_candidate("vllm", specifier=SpecifierSet(f"=={version}")).best_candidate
if best is None or not best.link.filename.endswith(".tar.gz"):
    sys.exit(f"no source distribution of vllm=={version} on the index: {best}")
dest.mkdir(parents=True, exist_ok=True)
target = dest / best.link.filename
with session.get(best.link.url.split("#")[0], stream=True) as response, open(target, "wb") as out:
    response.raise_for_status()
    for block in response.iter_content(1 << 20):
        out.write(block)
print(target)
