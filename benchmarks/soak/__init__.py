"""Long runs: a million requests with faults through one proxy (`soak`), and through a
model host (`soak_host`)."""
