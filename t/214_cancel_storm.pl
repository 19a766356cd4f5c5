
# Copyright: the idempotency extension authors.
#
# 214_cancel_storm.pl: nothing a call takes outlives its transaction, so a
# cancelled call leaves nothing held.
#
# Four long-lived sessions, connected as an application role that has only
# USAGE on schema idempotency (and EXECUTE on idem_sweep, granted as an
# operator grants it), run a few hundred iterations each of: SET
# statement_timeout to a random 1 to 5 ms, then one call (idem_claim of a
# key from a pool of 20, some with a wait; idem_finish, idem_extend,
# idem_release or idem_checkpoint with a token the session got earlier;
# idem_claim_many of 3 to 5 pool keys; idem_finish_many; idem_sweep()), or
# an explicit transaction of a few such calls that commits or rolls back.
# The timeouts cancel calls at every point of their work; the errors that
# follow (57014 and the documented token errors) are expected and counted,
# any other SQLSTATE fails.  The random choices come from a fixed seed, so a
# run can be repeated.
#
# What it proves, with the four sessions still connected and idle:
#   - none of them holds any lock (pg_locks), no advisory lock is held by
#     anybody, and none is idle in a transaction;
#   - once no live lease is left (the test lets the remaining ones end: it
#     releases some keys and shortens the others' leases with their stored
#     tokens), every pool key answers its next claim correctly: claimed
#     (attempt 1 when absent, the stored attempt + 1 when it was pending)
#     with a token larger than any stored one, or replay of the stored
#     result; never in_progress.  A key claimed there is finished and then
#     replays.
# Session-bound claims stay out of the storm: in the C edition their
# binding is a lock held for the session's life by design.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).
# Port 55514 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use List::Util qw(shuffle);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

srand(214);

my $node = new_node('cancel_storm', port => 55514,
	conf => [ 'idempotency.sweep_interval = 0' ], extension => 1);

sub sql { return $node->safe_psql('postgres', $_[0]); }

# The test's own calls after the storm: nothing else runs then, so none of
# them has a lock to wait for.  Should a lock left behind by an idle storm
# session block one, lock_timeout ends it with an error the checks report,
# instead of a wait that lasts as long as that session.
sub call_state
{
	my ($call) = @_;
	return sqlstate_of($node, 'postgres', "SET lock_timeout = '10s';\n$call");
}

# idem_claim($args) as claim() answers it, or { outcome => 'error SQLSTATE' }.
sub claim_or_error
{
	my ($args) = @_;
	my ($state, $out) = sql_result($node, 'postgres',
		"SET lock_timeout = '10s';\nSELECT $CLAIM_COLS FROM idempotency.idem_claim($args)");
	return $state eq '00000' ? parse_claim($out, lenient => 1) : { outcome => "error $state" };
}

# The application role: it may use the schema and call what PUBLIC may
# call, plus idem_sweep; it has no right on the table.
my $app = 'storm_app';
sql(qq{CREATE ROLE $app LOGIN;
GRANT USAGE ON SCHEMA idempotency TO $app;
GRANT EXECUTE ON FUNCTION idempotency.idem_sweep TO $app;});
is(sqlstate_of($node, 'postgres', 'SELECT count(*) FROM idempotency.keys', user => $app),
	'42501', 'the application role cannot read the table');

# The pool: 20 keys, each always claimed with the same request, odd ones
# with a lease of 50 ms (they come up for takeover during the storm), even
# ones with a lease of a minute.
my @pool = map { sprintf('s%02d', $_) } 1 .. 20;
my %request = map { $_ => sprintf('{"k": %d}', substr($_, 1)) } @pool;
sub lease_of { return substr($_[0], 1) % 2 ? '50 milliseconds' : '1 minute'; }

sub pick { return $_[ int(rand(@_)) ]; }

# The SQL of one call in the session whose tracked tokens are %$tok (key =>
# the last token the session was given for it).  A claim's output lines
# "tok|key|token" feed the tracking.
sub one_call
{
	my ($tok) = @_;
	my @held = sort keys %$tok;
	my $r = rand();
	if ($r < 0.30 || !@held)
	{
		my $k = pick(@pool);
		my $wait = rand() < 0.3 ? ", wait => '20 milliseconds'" : '';
		return "SELECT 'tok|$k|' || token FROM idempotency.idem_claim('$k', "
		  . "request => '$request{$k}', lease => '" . lease_of($k) . "'$wait) "
		  . "WHERE token IS NOT NULL;";
	}
	if ($r < 0.42)
	{
		my @k = (shuffle @pool)[ 0 .. 2 + int(rand(3)) ];
		return "SELECT 'tok|' || key || '|' || token FROM idempotency.idem_claim_many("
		  . "ARRAY[" . join(', ', map { "'$_'" } @k) . "], "
		  . "requests => ARRAY[" . join(', ', map { "'$request{$_}'" } @k) . "]::jsonb[], "
		  . "lease => '" . lease_of(pick(@k)) . "') WHERE token IS NOT NULL;";
	}
	my $k = pick(@held);
	my $t = $tok->{$k};
	if ($r < 0.57)
	{
		delete $tok->{$k};
		my ($status, $code) = rand() < 0.8 ? ('succeeded', 200) : ('failed', 500);
		return "SELECT idempotency.idem_finish('$k', $t, $code, '{\"by\": $t}', "
		  . "status => '$status');";
	}
	if ($r < 0.65)
	{
		return "SELECT idempotency.idem_extend('$k', $t, '" . lease_of($k) . "');";
	}
	if ($r < 0.73)
	{
		delete $tok->{$k};
		return "SELECT idempotency.idem_release('$k', $t);";
	}
	if ($r < 0.83)
	{
		return "SELECT idempotency.idem_checkpoint('$k', $t, 'step-$t', '{\"at\": $t}');";
	}
	if ($r < 0.93)
	{
		my @k = (shuffle @held)[ 0 .. (@held > 3 ? 2 : $#held) ];
		my @t = map { $tok->{$_} } @k;
		delete @$tok{@k};
		return "SELECT count(*) FROM idempotency.idem_finish_many("
		  . "ARRAY[" . join(', ', map { "'$_'" } @k) . "], "
		  . "ARRAY[" . join(', ', @t) . "]::bigint[], "
		  . "ARRAY[" . join(', ', map { 201 } @k) . "]);";
	}
	return 'SELECT * FROM idempotency.idem_sweep();';
}

# One iteration: a call under a fresh timeout, or (one time in ten) an
# explicit transaction of two or three calls, each under its own timeout,
# that commits or rolls back.  A cancel inside the transaction aborts it,
# and its COMMIT then rolls it back.
sub timeout_sql { return sprintf("SET statement_timeout = '%dms';\n", 1 + int(rand(5))); }

sub iteration
{
	my ($tok) = @_;
	return timeout_sql() . one_call($tok) . "\n" if rand() >= 0.1;
	my $sql = "BEGIN;\n";
	$sql .= timeout_sql() . one_call($tok) . "\n" for 1 .. 2 + int(rand(2));
	return $sql . (rand() < 0.7 ? "COMMIT;\n" : "ROLLBACK;\n");
}

# The sessions: psql without ON_ERROR_STOP, errors reported as their
# SQLSTATE alone.
my $n_sessions = 4;
my (@sessions, @pids, @tokens);
for my $i (0 .. $n_sessions - 1)
{
	my $s = $node->background_psql('postgres',
		on_error_stop => 0, extra_params => [ '-U', $app ]);
	$s->set_query_timer_restart;
	$s->query_safe("\\set ON_ERROR_STOP 0\n\\set VERBOSITY sqlstate");
	push @pids, $s->query_safe('SELECT pg_backend_pid()');
	push @sessions, $s;
	push @tokens, {};
}
my $pid_list = join(', ', @pids);

# Send each session its batch (all of them first, so they run at the same
# time), then collect each one's output up to its end mark on stdout and
# on stderr.  Returns the outputs (stdout), and counts the SQLSTATEs of the
# expected errors in %errors; any other line on stderr goes to @unexpected.
# Expected: a cancel (57014); the token errors of a call whose key moved
# on; 25P02 for the calls after a cancel inside a transaction; and the
# warning 25P01 of a COMMIT or ROLLBACK whose BEGIN was itself cancelled.
my %errors;
my @unexpected;
my $expected_errors = qr/^(?:57014|55006|55000|P0002|55P03|40P01|25P02|25P01)$/;
my $round = 0;

sub run_batches
{
	my (@batch) = @_;
	$round++;
	my $mark = "storm round $round done";
	for my $i (0 .. $#sessions)
	{
		$sessions[$i]{stdin} .= $batch[$i] . "\\echo '$mark'\n\\warn '$mark'\n";
		$sessions[$i]{run}->pump_nb;
	}
	my @out;
	for my $s (@sessions)
	{
		my $out = $s->query_until(qr/\Q$mark\E\n/, '');
		$out =~ s/\Q$mark\E\n//;
		pump_until($s->{run}, $s->{timeout}, \$s->{stderr}, qr/\Q$mark\E\n/)
		  or die "session stderr did not reach '$mark'";
		foreach my $line (split /\n/, $s->{stderr})
		{
			next if $line eq $mark;
			my ($state) = $line =~ /(?:ERROR|WARNING):\s+([0-9A-Z]{5})\s*$/;
			if (defined $state && $state =~ $expected_errors)
			{
				$errors{$state}++;
			}
			else
			{
				push @unexpected, $line;
			}
		}
		$s->{stderr} = '';
		push @out, $out;
	}
	return @out;
}

# The storm: 16 rounds of 25 iterations per session.
my $iterations = 0;
for (1 .. 16)
{
	my @batch;
	for my $i (0 .. $#sessions)
	{
		push @batch, join('', map { iteration($tokens[$i]) } 1 .. 25);
		$iterations += 25;
	}
	my @out = run_batches(@batch);
	for my $i (0 .. $#sessions)
	{
		$tokens[$i]{$1} = $2 while $out[$i] =~ /^tok\|(\S+)\|(\d+)$/mg;
	}
}
note("storm: $iterations iterations in $n_sessions sessions; errors: "
	  . join(', ', map { "$_ $errors{$_}" } sort keys %errors));
cmp_ok($errors{57014} // 0, '>', 0, 'storm: statement timeouts cancelled calls');
is(join("\n", @unexpected), '', 'storm: no error but the expected ones');

# Each session ends its timeout and answers one more round trip: from then
# on it is idle, and whatever it still held would be held by an idle
# session.
my @last = run_batches(("RESET statement_timeout;\nSELECT 'idle';\n") x $n_sessions);
is_deeply([ map { s/\s+$//r } @last ], [ ('idle') x $n_sessions ],
	'every session answered its last round trip');

###############################################################################
# Nothing is held
###############################################################################
is(sql("SELECT count(*) FROM pg_stat_activity WHERE pid IN ($pid_list) AND state = 'idle'"),
	$n_sessions, 'all storm sessions are connected and idle');
is( sql("SELECT count(*) FROM pg_stat_activity WHERE pid IN ($pid_list) "
		  . "AND state LIKE 'idle in transaction%'"),
	'0', 'no storm session is idle in a transaction');
is( sql("SELECT count(*) FROM pg_locks WHERE pid <> pg_backend_pid() AND pid IN ($pid_list)"),
	'0', 'the idle storm sessions hold no lock');
is( sql("SELECT coalesce(string_agg(concat_ws(' ', pid, classid, objid, objsubid, mode), ', '), '') "
		  . "FROM pg_locks WHERE locktype = 'advisory'"),
	'', 'no advisory lock is held by anybody');

###############################################################################
# Every pool key answers correctly
###############################################################################
# The keys still under a live lease: some are released, the others get a
# lease of a millisecond, each with its stored token.
my $live = sql("SELECT string_agg(key || ':' || token, ' ' ORDER BY key) FROM idempotency.keys "
	  . "WHERE status = 'pending' AND lease_until > clock_timestamp() AND token IS NOT NULL");
my ($released, $shortened) = (0, 0);
foreach (split / /, $live)
{
	my ($k, $t) = split /:/;
	if (substr($k, 1) % 3 == 0)
	{
		is(call_state("SELECT idempotency.idem_release('$k', $t)"), '00000',
			"$k: its live claim is released");
		$released++;
	}
	else
	{
		is(call_state("SELECT idempotency.idem_extend('$k', $t, '1 millisecond')"), '00000',
			"$k: its lease is shortened to a millisecond");
		$shortened++;
	}
}
note("after the storm: $released live claims released, $shortened leases shortened");
ok( $node->poll_query_until('postgres',
		    "SELECT count(*) = 0 FROM idempotency.keys "
		  . "WHERE status = 'pending' AND lease_until > clock_timestamp()"),
	'no live lease is left');

my %stored;
foreach my $line (split /\n/,
	sql("SELECT concat_ws('|', key, status, attempt, coalesce(response_code::text, ''), "
		  . "coalesce(md5(response_body::text), '')) FROM idempotency.keys WHERE scope = ''"))
{
	my ($k, $status, $attempt, $code, $md5) = split /\|/, $line, -1;
	$stored{$k} = { status => $status, attempt => $attempt, code => $code, md5 => $md5 };
}
my $max_token = sql('SELECT coalesce(max(token), 0) FROM idempotency.keys');
my %seen;
foreach my $k (@pool)
{
	my $row = $stored{$k};
	my $state = $row ? $row->{status} : 'absent';
	$seen{$state}++;
	my $c = claim_or_error("'$k', request => '$request{$k}', lease => '1 hour'");
	if ($state eq 'succeeded' || $state eq 'failed')
	{
		is_deeply($c, replay_row($state, $row->{code}, $row->{md5} eq '' ? undef : $row->{md5}),
			"$k ($state): replays the stored result");
		next;
	}
	my $attempt = $state eq 'pending' ? $row->{attempt} + 1 : 1;
	is($c->{outcome} . "," . ($c->{attempt} // "none"), "claimed,$attempt",
		"$k ($state" . ($row ? ", attempt $row->{attempt}" : '') . "): claimed as attempt $attempt");
	cmp_ok($c->{token} // 0, '>', $max_token, "$k: with a token larger than any stored one");
	is(call_state("SELECT idempotency.idem_finish('$k', " . ($c->{token} // 0) . ", 202)"),
		'00000', "$k: finished");
	is_deeply(claim_or_error("'$k', request => '$request{$k}'"),
		replay_row('succeeded', 202, undef), "$k: then replays");
}
note('pool keys after the storm: ' . join(', ', map { "$_ $seen{$_}" } sort keys %seen));

$_->quit for @sessions;
unlike(slurp_file($node->logfile), qr/terminated by signal/, 'no backend crashed');
$node->stop;
done_testing();
