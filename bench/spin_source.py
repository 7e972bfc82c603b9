"""
The overlap workload's two halves, as source that benchmark programs
upload: C{CPU_WORK}'s C{cpu_work(ms)} busy-waits C{ms} milliseconds on the
host (the module must import C{time}), and C{CALIBRATED_SLEEP}'s
C{_cycles_per_ms(torch)} calibrates C{torch.cuda._sleep} once per worker
process (cycles per millisecond, by CUDA events), so a function can launch
a spin of about C{ms} milliseconds with C{torch.cuda._sleep(int(ms *
_cycles_per_ms(torch)))}.  Standard library only: C{ref_driver.py} imports
it beside the reference client, C{overlap.py} beside ours.
"""

CPU_WORK = """
def cpu_work(ms):
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass
    return ms
"""

CALIBRATED_SLEEP = '''
def _cycles_per_ms(torch):
    """Cycles of torch.cuda._sleep per millisecond, measured once per worker process."""
    rate = getattr(torch.cuda, "_kcoral_bench_cycles_per_ms", None)
    if rate is None:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        start.record()
        torch.cuda._sleep(cycles)
        stop.record()
        stop.synchronize()
        rate = cycles / start.elapsed_time(stop)
        torch.cuda._kcoral_bench_cycles_per_ms = rate
    return rate
'''
