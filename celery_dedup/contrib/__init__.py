"""Integrations with other frameworks; each is optional and imported only when used."""
