"""Hooks that tests and planted CI runs switch on; nothing here runs unless asked for."""
