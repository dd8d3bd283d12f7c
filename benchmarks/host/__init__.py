"""The model host: its transport (`host`) and the CPU per request through it, HTTP
included (`host_cpu`)."""
