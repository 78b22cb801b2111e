"""The coordinator: membership epochs, failure detection, the HTTP API and the c10d store host."""
