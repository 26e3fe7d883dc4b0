"""Load generation and measurement shared by the live benchmark (`tandem bench`) and the simulator."""
