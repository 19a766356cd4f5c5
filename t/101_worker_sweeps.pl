
# Copyright: the idempotency extension authors.
#
# 101_worker_sweeps.pl: with shared_preload_libraries = 'idempotency' the
# background worker, and nobody calling idem_sweep(), expires finished keys
# past their retention (compacting a remembered one, which then answers
# expired) and resets stale pending keys in every database that
# has the extension (notifying idempotency_abandoned, which a session
# listening there hears): two databases created before the first sweep, one
# database created after start-up whose extension comes later still.  Keys
# under a live lease or within their retention are left exactly as they
# were.  Template databases and databases that refuse connections are not
# visited until they become ordinary again.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl), e.g.
#   prove -v t/101_worker_sweeps.pl
# No assertion depends on timing: the test polls the table (and the stats
# view's last_sweep_at for "the worker made another round").

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

skip_sql_edition(
	"the background worker sweeps here; the SQL edition has none (sweeping is idem_sweep() from the application or pg_cron)");

my $node = new_node('sweeps', port => 55444,
	conf => ["idempotency.sweep_interval = '300ms'"]);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

# Every column of a stored key but sweep_at (the worker's own schedule, which
# it may move), as one line ('' when the key is absent).
sub row_but_sweep_at
{
	my ($db, $key) = @_;
	return sql($db,
		    "SELECT status, token, attempt, encode(fingerprint, 'hex'), "
		  . "response_code, response_body, created_at, finished_at, "
		  . "lease_until, expires_at, retention "
		  . "FROM idempotency.keys WHERE scope = '' AND key = '$key'");
}

# The columns of a pending key that a reset must leave alone.
sub pending_core
{
	my ($db, $key) = @_;
	return sql($db,
		    "SELECT status, attempt, encode(fingerprint, 'hex'), "
		  . "response_code, response_body, created_at, finished_at, "
		  . "lease_until, expires_at, retention "
		  . "FROM idempotency.keys WHERE scope = '' AND key = '$key'");
}

# Let the worker make $n more complete rounds: each time, wait until the
# last sweep of database "postgres" is later than it was.  Two advances
# mean that at least one whole round over every database lay in between.
sub wait_rounds
{
	my ($n) = @_;
	for my $i (1 .. $n)
	{
		ok(wait_next_sweep($node, 'postgres'),
			"the worker swept database postgres again (round $i of $n)");
	}
}

# Database "postgres" has the extension: its last_sweep_at counts rounds.
sql('postgres', 'CREATE EXTENSION idempotency');

# Claim key $key in $db with the arguments $claim_args and finish it with
# the claim's token and the further arguments $finish_args, in one
# statement.  Returns the claim's row (as claim).  One statement is one
# transaction: the worker never sees the key pending, so it cannot reset it
# under its short lease before the finish, however slow the client is.
sub claim_finished
{
	my ($db, $key, $claim_args, $finish_args) = @_;
	return parse_claim(
		sql($db,
			    "SELECT $CLAIM_COLS FROM idempotency.idem_claim('$key', $claim_args) AS c "
			  . "WHERE idempotency.idem_finish('$key', c.token, $finish_args) IS NOT NULL"));
}

# Keys of every kind, in one database.  Returns the tokens by key.
sub populate
{
	my ($db) = @_;
	my %tok;
	my $c;

	# Three finished keys whose retention is short: the worker expires them.
	for my $i (1 .. 3)
	{
		my $status = $i == 3 ? 'failed' : 'succeeded';
		$c = claim_finished($db, "exp-$i",
			"request => '{\"i\": $i}', lease => '1 second', retention => '1 second'",
			"200, '{\"n\": $i}', status => '$status'");
		is($c->{outcome}, 'claimed', "$db: exp-$i claimed");
	}

	# Retention shorter than the lease it was claimed with, and longer:
	# both are deleted once past retention (whenever the worker looks).
	$c = claim_finished($db, 'exp-longlease', "lease => '3 seconds'",
		"200, retention => '1 second'");
	is($c->{outcome}, 'claimed', "$db: exp-longlease claimed");
	$c = claim_finished($db, 'exp-resched', "lease => '1 second'",
		"200, retention => '3 seconds'");
	is($c->{outcome}, 'claimed', "$db: exp-resched claimed");

	# A finished key remembered for a day after its one-second retention:
	# the worker compacts it (its response goes, its outcome stays).
	$c = claim_finished($db, 'rem', "request => '{\"r\": 1}', lease => '1 second', "
		  . "retention => '1 second', remember => '1 day'",
		"201, '{\"n\": \"rem\"}'");
	is($c->{outcome}, 'claimed', "$db: rem claimed");

	# A finished key kept for a day: the worker must not touch it.
	$c = claim($node, $db, "'keep', request => '{\"k\": 1}'");
	is($c->{outcome}, 'claimed', "$db: keep claimed");
	sql($db,
		"SELECT idempotency.idem_finish('keep', $c->{token}, 201, "
		  . "'{\"kept\": \"$db\"}', retention => '1 day')");
	$tok{keep} = $c->{token};

	# A pending key whose lease runs out (its retention does not): reset.
	$c = claim($node, $db,
		"'stale', request => '{\"s\": 1}', lease => '1 second', "
		  . "retention => '1 day'");
	is($c->{outcome}, 'claimed', "$db: stale claimed");
	is($c->{attempt}, 1,         "$db: stale is attempt 1");
	$tok{stale} = $c->{token};

	# A pending key under a live lease: left alone.
	$c = claim($node, $db, "'live', request => '{\"l\": 1}', lease => '1 hour'");
	is($c->{outcome}, 'claimed', "$db: live claimed");
	$tok{live} = $c->{token};

	# A pending key whose lease and retention both run out: deleted.
	$c = claim($node, $db,
		"'exp-pending', lease => '1 second', retention => '1 second'");
	is($c->{outcome}, 'claimed', "$db: exp-pending claimed");

	return \%tok;
}

# Wait until the worker has swept database $db: every exp-* key deleted
# and the stale key reset.  Then check everything else is untouched.
sub check_swept
{
	my ($db, $tok, $before) = @_;

	ok( $node->poll_query_until(
			$db,
			"SELECT count(*) FILTER (WHERE key LIKE 'exp-%') = 0 "
			  . "AND bool_and(token IS NULL) FILTER (WHERE key = 'stale') "
			  . "AND bool_and(response_body IS NULL AND sweep_at = expires_at + remember) "
			  . "FILTER (WHERE key = 'rem') "
			  . "FROM idempotency.keys"),
		"$db: the worker expired the exp-* keys, reset the stale key and compacted rem");

	is( sql($db, "SELECT string_agg(key, ',' ORDER BY key) FROM idempotency.keys"),
		'keep,live,rem,stale',
		"$db: exactly keep, live, rem and stale remain");
	is( sql($db,
			"SELECT outcome, status, response_code FROM idempotency.idem_claim('rem', "
			  . "'{\"r\": 1}')"),
		'expired|succeeded|201',
		"$db: the compacted key answers expired with its outcome");
	is(row_but_sweep_at($db, 'keep'), $before->{keep},
		"$db: the finished key within its retention is unchanged");
	is(row_but_sweep_at($db, 'live'), $before->{live},
		"$db: the pending key under a live lease is unchanged (same token)");
	is(pending_core($db, 'stale'), $before->{stale},
		"$db: the reset key keeps status, attempt, fingerprint, times");
	is( sql($db,
			"SELECT status, token IS NULL, attempt FROM idempotency.keys "
			  . "WHERE key = 'stale'"),
		'pending|t|1',
		"$db: the stale key is pending with no token, attempt 1");
	# Read before the claims below, whose keys the worker could reset or
	# expire once their leases end.
	is( sql($db,
			"SELECT expired, reset, last_sweep_at IS NOT NULL, last_sweep_ms >= 0 "
			  . "FROM idempotency.stats WHERE database = current_database()"),
		'7|1|t|t',
		"$db: stats count 7 expired (6 deleted, 1 compacted) and 1 reset; last_sweep_at is set");

	# The worker's reset killed the old token; the next claim takes over.
	is( sqlstate_of($node, $db,
			"SELECT idempotency.idem_finish('stale', $tok->{stale}, 200)"),
		'55006', "$db: finish with the token the worker reset: 55006");
	my $c = claim($node, $db, "'stale', request => '{\"s\": 1}'");
	is($c->{outcome}, 'claimed', "$db: the next claim of the reset key is claimed");
	is($c->{attempt}, 2,         "$db: ... as attempt 2");
	cmp_ok($c->{token}, '>', $tok->{live}, "$db: ... with a new, larger token");

	# An expired key behaves as absent: a new claim is a first attempt.
	$c = claim($node, $db, "'exp-1', request => '{\"other\": true}'");
	is($c->{outcome}, 'claimed', "$db: an expired key can be claimed with another request");
	is($c->{attempt}, 1,         "$db: ... as attempt 1");

}

# --- Two databases created before the worker's first round over them ---

my %tok;
my %before;
my $listener;
for my $db (qw(alpha beta))
{
	sql('postgres', "CREATE DATABASE $db");
	sql($db, 'CREATE EXTENSION idempotency');
	if ($db eq 'alpha')
	{
		# a completer's connection: it listens before any key is abandoned
		$listener = $node->background_psql('alpha');
		$listener->query_safe('LISTEN idempotency_abandoned');
	}
	$tok{$db} = populate($db);
	$before{$db} = {
		keep  => row_but_sweep_at($db, 'keep'),
		live  => row_but_sweep_at($db, 'live'),
		stale => pending_core($db, 'stale') };
	like($before{$db}{keep}, qr/^succeeded\|$tok{$db}{keep}\|1\|/,
		"$db: keep is stored as succeeded with its token");
}
for my $db (qw(alpha beta))
{
	check_swept($db, $tok{$db}, $before{$db});
}

# The worker's reset of "stale" (scope '') notified the listener in alpha.
# The notification arrives once the worker's transaction has committed and
# psql shows it after the next statement it runs: run one until it is there.
my $heard = '';
for (my $i = 0; $i < 10 * $PostgreSQL::Test::Utils::timeout_default; $i++)
{
	$heard .= $listener->query_safe('SELECT 1');
	last if $heard =~ /Asynchronous notification "idempotency_abandoned"/;
	usleep(100_000);
}
like($heard, qr/Asynchronous notification "idempotency_abandoned" received/,
	'alpha: the worker that reset a key of scope \'\' notified idempotency_abandoned (empty payload)');
$listener->quit;

# --- A database created after start-up, its extension created later ---

sql('postgres', 'CREATE DATABASE gamma');
# Nobody connects to gamma: its committed transactions are the worker's
# visits (which find no extension there yet).
ok(wait_commits($node, 'gamma', 2),
	'gamma: the worker visits the new database (no extension yet)');
wait_rounds(2);
is( sql('postgres',
		"SELECT count(*) FROM idempotency.stats WHERE database = 'gamma'"),
	'0', 'gamma: no sweep is recorded while the extension is absent');
sql('gamma', 'CREATE EXTENSION idempotency');
my $gamma_tok = populate('gamma');
my $gamma_before = {
	keep  => row_but_sweep_at('gamma', 'keep'),
	live  => row_but_sweep_at('gamma', 'live'),
	stale => pending_core('gamma', 'stale') };
check_swept('gamma', $gamma_tok, $gamma_before);

# --- Templates and databases that refuse connections are not visited ---

for my $db (qw(tmpl noconn))
{
	sql('postgres', "CREATE DATABASE $db");
	sql($db, 'CREATE EXTENSION idempotency');
}
# tmpl is a template before its key exists.  noconn's key is claimed and
# finished in a transaction that commits only once noconn refuses
# connections and every visit of the worker begun before that has ended
# (two more sweeps of postgres: a whole round lies between them), so no
# visit ever sees that key.
sql('postgres', 'ALTER DATABASE tmpl IS_TEMPLATE true');
my $noconn = $node->background_psql('noconn');
$noconn->query_safe('BEGIN');
is( parse_claim(
		$noconn->query_safe(
			    "SELECT $CLAIM_COLS FROM idempotency.idem_claim('exp-1', "
			  . "lease => '1 second', retention => '2 seconds') AS c "
			  . "WHERE idempotency.idem_finish('exp-1', c.token, 200) IS NOT NULL")
	)->{outcome},
	'claimed',
	'noconn: exp-1 claimed');
is(finish_key($node, 'tmpl', 'exp-1', '2 seconds')->{outcome},
	'claimed', 'tmpl: exp-1 claimed');
sql('postgres', 'ALTER DATABASE noconn ALLOW_CONNECTIONS false');
wait_rounds(2);
$noconn->query_safe('COMMIT');
$noconn->quit;
ok(wait_past_retention($node, 'tmpl', 'exp-1'),
	'tmpl: exp-1 is past its retention');
# noconn's key has the same retention and was finished earlier.
my $skipped_stats = sql('postgres',
	"SELECT database, claims, expired, last_sweep_at "
	  . "FROM idempotency.stats WHERE database IN ('tmpl', 'noconn') "
	  . "ORDER BY database");
wait_rounds(3);
is( sql('tmpl', "SELECT count(*) FROM idempotency.keys WHERE key = 'exp-1'"),
	'1', 'tmpl: the template database was not swept');
like($skipped_stats, qr/^noconn\|1\|0\|.*\ntmpl\|1\|0\|/,
	'tmpl, noconn: one claim each counted, nothing expired');
is( sql('postgres',
		"SELECT database, claims, expired, last_sweep_at "
		  . "FROM idempotency.stats WHERE database IN ('tmpl', 'noconn') "
		  . "ORDER BY database"),
	$skipped_stats,
	'tmpl, noconn: no sweep recorded over three rounds of the worker');

sql('postgres', 'ALTER DATABASE tmpl IS_TEMPLATE false');
sql('postgres', 'ALTER DATABASE noconn ALLOW_CONNECTIONS true');
ok( $node->poll_query_until(
		'tmpl', "SELECT count(*) = 0 FROM idempotency.keys"),
	'tmpl: swept once it is no longer a template');
ok( $node->poll_query_until(
		'noconn', "SELECT count(*) = 0 FROM idempotency.keys"),
	'noconn: swept once it allows connections');
is( sql('postgres',
		"SELECT database, expired, last_sweep_at IS NOT NULL "
		  . "FROM idempotency.stats WHERE database IN ('tmpl', 'noconn') "
		  . "ORDER BY database"),
	"noconn|1|t\ntmpl|1|t",
	'tmpl, noconn: one expired key each, and a recorded sweep');

# Nothing above called idem_sweep(): only the worker sweeps here.  It is
# one launcher, and never left an error in the log.
is( sql('postgres',
		"SELECT count(*) FROM pg_stat_activity "
		  . "WHERE backend_type = 'idempotency launcher'"),
	'1', 'exactly one idempotency launcher runs');
# Client sessions are tagged with the test's name (the 55006 above is ours).
is(log_errors($node), '',
	'no ERROR, FATAL, PANIC or failure in the log apart from the test\'s own');

$node->stop;
done_testing();
