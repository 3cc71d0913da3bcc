"""kvwatch's collectors: everything that gathers or produces data, and the `kvwatch` command."""
