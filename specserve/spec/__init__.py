"""Speculative decoding: drafters propose, `verify` accepts losslessly."""
