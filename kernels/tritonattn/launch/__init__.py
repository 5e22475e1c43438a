"""The launch layer: plans and launches the kernels of jit/ on validated inputs (prefill, backward,
decode and its replays, rotary), through `fast.LaunchCache`. It validates nothing: the api layer has."""
