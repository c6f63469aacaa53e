"""The course's pictures (PNG files beside this one, their data in data/,
screenshots in screenshots/) and, in make/, the code that makes them and
checks the pages against the measurements: `make pictures`, `make traces`,
`make samples`, `make figures`."""
