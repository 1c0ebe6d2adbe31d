"""One-off experiments and measurements run by hand, outside the installed package (pyproject's packages leave this
folder out). Each imports `specrt` as installed and runs from the repository root: `python -m experiments.<name>`."""
