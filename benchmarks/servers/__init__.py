"""batchproxy's kind of service beside the regular way and the peers over HTTP (`run`),
and one client at a time (`lone`): each stack a server in a process of its own."""
