"""Course support: formulas, simulators, widgets, quality measures, machine ceilings."""
