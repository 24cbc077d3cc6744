"""Parkade services: tokenizer, scheduler, executor, and the in-process engine."""
