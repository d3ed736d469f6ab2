"""The CPU engine's machinery: ISA and thread detection, core sharing between engines, the compiled
decode step (compiled in a child process into an on-disk cache, installed between steps, fenced from
FX tracing)."""
