# P's KV usage over time in case E (30% of clients leave D while queued; P is not told by the
# client): the 480 s timeout, a 30 s lease, and the 30 s lease with D's releases.
# Input: out/scenario_e_timeline.csv (written by `kvferry sim --scenario E --csv out`).
set datafile separator ","
set terminal pngcairo size 1000,500 noenhanced
set output "out/case_e.png"
set title "Case E: P's KV usage when 30% of clients cancel on D (simulated, full scale)"
set xlabel "time (s)"
set ylabel "P KV blocks in use (%)"
set yrange [0:105]
set xrange [0:600]
set key top right
set grid
set arrow from 40, graph 0 to 40, graph 1 nohead dashtype 2
set label "last cancellation" at 42, 101
plot "out/scenario_e_timeline.csv" using 1:2 with lines linewidth 2 title "480 s timeout (no lease, no release)", \
     "" using 1:3 with lines linewidth 2 title "30 s lease, no release", \
     "" using 1:4 with lines linewidth 2 title "30 s lease + release"
