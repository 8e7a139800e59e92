"""Broker transports whose publish runs the gate: kombu's Redis and Sentinel transports, gated (:mod:`.redis`)."""
