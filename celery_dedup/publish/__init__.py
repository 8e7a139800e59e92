"""The publisher's side: the gate's answer to a publish, the results callers get, bulk publishing, publishes by name."""
