"""Command-line interface: argument parsing only; every command calls one library function."""
