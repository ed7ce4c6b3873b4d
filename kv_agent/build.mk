# kv_agent daemon, client library and tests (filled in by the kv_agent work)
