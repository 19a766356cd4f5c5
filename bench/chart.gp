# bench/chart.gp: bar chart of bench/run's median ops/s per row (log scale).
# Called by bench/report.py: gnuplot -e "datafile='...'; outfile='...'" chart.gp
# Data columns: index, "label", ops/s, colour.  Blue: the extension; grey:
# what users write instead (seed patterns, PL/pgSQL peer); green: the floor /
# bare statements; red: Redis (orientation).
set terminal pngcairo size 1400,720 font "DejaVu Sans,10" noenhanced
set output outfile
set title "idempotency benchmark: median ops/s per row (higher is better, log scale)"
set style fill solid 0.85 border -1
set boxwidth 0.7
set logscale y
set yrange [100:*]
set ylabel "ops/s"
set grid ytics
set xtics rotate by -40 left nomirror
set key off
set bmargin 9
set rmargin 14
plot datafile using 1:3:4:xtic(2) with boxes lc rgb variable, \
     '' using 1:3:(sprintf("%.0f", $3)) with labels offset 0,0.7 font ",8"
