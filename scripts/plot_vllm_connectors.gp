# P's KV usage over time through real vllm serve engines, one line per connector, for the seed's
# cases A (D SIGKILLed at t=0), B (D overloaded, no crash) and E (30% of clients leave while
# queued on D, at t=0). Input: OUTDIR/case_{a,b,e}.csv and OUTDIR/events.gp, written by
# python/bench/bench_vllm_connectors.py (scripts/demo-vllm.sh), which also runs this:
#   gnuplot -e 'outdir="out/vllm"' scripts/plot_vllm_connectors.gp
if (!exists("outdir")) outdir = "out/vllm"
load outdir."/events.gp"
set datafile separator ","
set terminal pngcairo size 1000,500 noenhanced
set ylabel "P KV cache usage (%)"
set yrange [0:105]
set grid
set key top right

if (a_ncols > 1) {
  set output outdir."/case_a.png"
  set title sprintf("Case A (real vllm serve): P's KV after D is SIGKILLed at t=0; lease %g s, Mooncake timeout %g s", lease, timeout)
  set xlabel "time since D was killed (s)"
  set arrow 1 from 0, graph 0 to 0, graph 1 nohead dashtype 2
  # "using 1:i" (a column number, not an expression): empty fields are skipped, lines stay joined
  plot for [i=2:a_ncols] outdir."/case_a.csv" using 1:i with lines linewidth 2 title columnheader(i)
  unset arrow 1
}
if (b_ncols > 1) {
  set output outdir."/case_b.png"
  set title sprintf("Case B (real vllm serve): P's KV while D serves one request at a time; lease %g s, Mooncake timeout %g s", lease, timeout_b)
  set xlabel "time since the load started (s)"
  plot for [i=2:b_ncols] outdir."/case_b.csv" using 1:i with lines linewidth 2 title columnheader(i)
}
if (e_ncols > 1) {
  set output outdir."/case_e.png"
  set title sprintf("Case E (real vllm serve): 30%% of clients leave while queued on D at t=0; lease %g s, Mooncake timeout %g s", lease, timeout)
  set xlabel "time since the clients left (s)"
  set arrow 1 from 0, graph 0 to 0, graph 1 nohead dashtype 2
  plot for [i=2:e_ncols] outdir."/case_e.csv" using 1:i with lines linewidth 2 title columnheader(i)
  unset arrow 1
}
