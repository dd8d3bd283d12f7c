"""What every benchmark shares: its command line and JSON report (`report`), the
closed-loop driver over a fixed set of items (`drain`), and the HTTP load generator in
client processes of its own (`clients`)."""
