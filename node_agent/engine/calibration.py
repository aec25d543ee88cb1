"""A short built-in text whose K/V activations calibrate the static FP8 KV scales at load."""

CALIBRATION_TEXT = (
    "The lighthouse stood at the edge of the harbour for two hundred years. Every night its keeper "
    "climbed 117 steps, trimmed the wick and wound the clockwork that turned the lens. Ships counted "
    "its flashes: three short, one long.\n\n"
    "def moving_average(values, window):\n"
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n"
    "    return out\n\n"
    "User: What is the boiling point of water at sea level?\n"
    "Assistant: Water boils at 100 degrees Celsius (212 degrees Fahrenheit) at sea level.\n"
    "Q: 17 * 23 = ? A: 391. Les feuilles tombent en automne; die Blätter fallen im Herbst.\n"
    "Key facts: Paris is the capital of France; the Pacific is the largest ocean; DNA has four bases."
)
