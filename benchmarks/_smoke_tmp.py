import time, torch, collections, statistics
from torch.autograd.profiler import profile
x, y = torch.randn(16 * 2**20, device="cuda"), torch.randn(16 * 2**20, device="cuda")
fn = lambda a, b: torch.add(a, b, alpha=0.5)
with profile(use_cpu=False, use_device="cuda", use_kineto=True) as p:
    fn(x, y); x.zero_(); torch.cuda.synchronize()
print([m for m in dir(torch._C._autograd._KinetoEvent) if not m.startswith("_")])
print(collections.Counter((str(e.device_type()), e.name()[:40]) for e in p.kineto_results.events()))
from cudagym.sandbox.timing import DeviceTimer
t = DeviceTimer(torch.device("cuda"))
for _ in range(20): t.call(fn, [x, y])
t0 = time.perf_counter(); t.start()
for _ in range(200): t.call(fn, [x, y])
times = t.finish(); t1 = time.perf_counter()
print("median", statistics.median(times), "busy", statistics.median(t.kernel_ms), "loop+finish s", t1 - t0)
t0 = time.perf_counter(); t.start()
for _ in range(500): t.call(fn, [x, y])
t.finish(); print("500 calls + finish s", time.perf_counter() - t0)
