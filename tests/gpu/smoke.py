"""First thing on a GPU host: can the package load and can each template's kernel run once?

Prints torch/tvm-ffi facts, then calls one mini example kernel per template with a watchdog (a hung
kernel dumps every thread's stack and exits instead of eating the whole run). Usage:
    python3 tests/gpu/smoke.py PACKAGE_DIR
"""

import faulthandler
import sys
import time

import torch

t0 = time.time()
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(),
      "| native DLPack exchange API:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"), flush=True)
faulthandler.dump_traceback_later(60, exit=True)
import tvm_ffi  # noqa: E402

print(f"tvm_ffi {tvm_ffi.__version__} imported in {time.time() - t0:.1f}s", flush=True)
from k3compile import kernel_check as kc  # noqa: E402
from k3compile.package import KernelPackage  # noqa: E402

pkg = KernelPackage(sys.argv[1])
done = set()
for name, k in sorted(pkg.kernels.items(), key=lambda kv: kv[1].get("example", "")):
    t = k["template"]
    if t in done or "mini_" not in k.get("example", ""):
        continue
    done.add(t)
    faulthandler.dump_traceback_later(30, exit=True)
    t1 = time.time()
    point = pkg.point(name)
    fn = pkg.function(name)
    res = kc.check(point, fn, seed=1)
    print(f"{'ok  ' if res['ok'] else 'FAIL'} {k['example']:<32} {time.time() - t1:5.1f}s {res['errors']} "
          f"{res['problems']}", flush=True)
faulthandler.cancel_dump_traceback_later()
print(f"smoke done in {time.time() - t0:.1f}s", flush=True)
