
# Copyright: the idempotency extension authors.
#
# 120_token_block.pl: with the library preloaded, fencing tokens come from
# a block per database that a refill reserves ahead of need, each refill
# made durable before any token of it leaves.  The blocks are tiny here
# (idempotency.test_token_block = 4, a test build's setting), so that
# claims use them up and refill them all the time.  What it proves:
#   - sessions that claim at once, each in a transaction left open (no
#     commit flushes anything), never get the same token; after an
#     immediate stop (a crash) and a restart, every token is above every
#     token a client saw before; three rounds, none repeating a token of
#     another;
#   - a refill that stops half-way (at the pause point "token-refill", its
#     sequence record written but not yet flushed) makes the sessions that
#     find the block used up wait (wait event Extension); cancelling it
#     hands out nothing and lets a waiting session refill instead, and so
#     does terminating it (its exit gives the refill up);
#   - an administrator's setval forward holds from the next refill on, and
#     setting the sequence back does not make tokens go back;
#   - DROP EXTENSION and CREATE EXTENSION in the same database start a new
#     block from the new sequence (its first token is 1), and so does a new
#     database;
#   - without preloading, where tokens come from nextval one by one, a
#     sequence set back hands another session the binding of a live
#     session-bound session: its session-bound claim is refused (55000).
#
# The WAL writer must not flush the refills' records on its own before a
# crash (wal_writer_delay = 10s, wal_writer_flush_after = 0), nor a commit
# of autovacuum.  Needs a test build (make IDEM_TEST_PAUSES=1); the SQL
# edition has no blocks.  Run as described at the top of t/001_restart.pl.
# Ports 55480 and 55481 only name the socket files.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use List::Util qw(max min);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

skip_sql_edition('its tokens come from the sequence one by one, there is no '
	  . 'shared memory to keep a block in');

my $node = new_node('blocks', port => 55480,
	conf => ["wal_writer_delay = '10s'", "wal_writer_flush_after = 0",
		"autovacuum = off", "idempotency.sweep_interval = 0",
		"idempotency.test_token_block = 4"],
	extension => 1);

sub sql { return $node->safe_psql('postgres', $_[0]); }

if (sql("SELECT current_setting('idempotency.test_token_block', true) IS NULL") eq 't')
{
	$node->stop;
	plan(skip_all => 'needs a test build (make IDEM_TEST_PAUSES=1)');
}

# Every token a client saw, in the order seen.
my @seen;

# What a background session printed up to its "done" line, given what an
# earlier query_until already returned: that may hold the "done" line too
# (the call can finish before the harness reads "started"), and
# query_until hands back and forgets what it read.
sub output_until_done
{
	my ($s, $buf) = @_;
	return $buf =~ /done\n/ ? $buf : $buf . $s->query_until(qr/done\n/, '');
}

# No token of @tokens was seen before, and none twice.
sub all_new
{
	my ($what, @tokens) = @_;
	my %count;
	$count{$_}++ for (@seen, @tokens);
	is(join(',', grep { $count{$_} > 1 } sort { $a <=> $b } keys %count), '',
		"$what: no token is handed out twice");
}

# --- concurrent claims, then a crash, three times ------------------------------
for my $round (1 .. 3)
{
	my $before = @seen ? max(@seen) : 0;
	my @sessions;
	for my $i (1 .. 4)
	{
		my $s = $node->background_psql('postgres');
		$s->query_safe('BEGIN');
		my @keys = map { "r$round-$i-$_" } 1 .. 25;
		# single claims and a batch, all at once with the other sessions
		$s->{buf} = $s->query_until(qr/started\n/,
			"\\echo started\n"
			  . "SELECT token FROM generate_series(1, 15) AS g, "
			  . "LATERAL idempotency.idem_claim('r$round-$i-s' || g, scope => 'crash') "
			  . "UNION ALL SELECT token FROM idempotency.idem_claim_many(ARRAY['"
			  . join("', '", @keys)
			  . "'], scope => 'crash');\n\\echo done\n");
		push @sessions, $s;
	}
	my @tokens;
	for my $s (@sessions)
	{
		my $out = output_until_done($s, $s->{buf});
		$out =~ s/^.*?started\n//s;
		$out =~ s/\n?done\n.*//s;
		push @tokens, grep { /^\d+$/ } split /\n/, $out;
	}
	is(scalar(@tokens), 160, "round $round: four sessions got 40 tokens each");
	all_new("round $round", @tokens);
	cmp_ok(min(@tokens), '>', $before,
		"round $round: every token is above every token seen before the last crash");
	push @seen, @tokens;

	$node->stop('immediate');
	$_->{run}->kill_kill for @sessions;
	$node->start;
	is(sql("SELECT count(*) FROM idempotency.keys WHERE scope = 'crash'"), '0',
		"round $round: nothing of the open transactions survived the crash");
}
my $after = claim($node, 'postgres', "'after-crash', scope => 'crash'");
cmp_ok($after->{token}, '>', max(@seen),
	'after the last crash: the first token is above every token seen');
push @seen, $after->{token};

# --- a refill that stops half-way ----------------------------------------------

# A session whose claim runs; returns once $cond holds for its backend.
sub start_claim
{
	my ($what, $select, $cond) = @_;
	my $s = $node->background_psql('postgres', on_error_stop => 0);
	my $pid = $s->query_safe('SELECT pg_backend_pid()');
	my $buf = $s->query_until(qr/started\n/,
		"\\set VERBOSITY verbose\n\\echo started\n$select;\n\\echo done\n");
	ok($node->poll_query_until('postgres',
			"SELECT $cond FROM pg_stat_activity WHERE pid = $pid"),
		"$what: the claim is where the test wants it");
	return { what => $what, s => $s, pid => $pid, buf => $buf };
}

# The tokens a claim started by start_claim printed, once it has returned.
sub claim_output
{
	my ($c) = @_;
	my $out = output_until_done($c->{s}, $c->{buf});
	$out =~ s/^.*?started\n//s;
	$out =~ s/\n?done\n.*//s;
	return grep { /^\d+$/ } split /\n/, $out;
}

for my $how ('cancel', 'terminate')
{
	my $hold = $node->background_psql('postgres');
	$hold->query_safe("SELECT pg_advisory_lock(7655)");

	# Its own block size is so large that its claim refills after drawing.
	my $refiller = start_claim("$how: the refiller",
		"SET idempotency.test_token_block = 1000000;\n"
		  . "SET idempotency.test_pause = 'token-refill';\n"
		  . "SELECT token FROM idempotency.idem_claim('$how-refill', scope => 'refill')",
		"wait_event_type = 'Lock' AND query LIKE '%idem_claim%'");

	# What remains of the block goes, then the waiter waits for the refill.
	my $waiter = start_claim("$how: the waiter",
		"SELECT token FROM idempotency.idem_claim_many(ARRAY['$how-1', '$how-2', "
		  . "'$how-3', '$how-4', '$how-5', '$how-6'], scope => 'refill') ORDER BY ord",
		"wait_event = 'Extension' OR state <> 'active'");
	is(sql("SELECT wait_event FROM pg_stat_activity WHERE pid = $waiter->{pid}"),
		'Extension', "$how: the waiter waits for the refill under way");

	if ($how eq 'cancel')
	{
		is(sql("SELECT pg_cancel_backend($refiller->{pid})"), 't',
			'cancel: the refiller is cancelled');
		is(join(',', claim_output($refiller)), '', 'cancel: the refiller returns no token');
		like($refiller->{s}{stderr}, qr/ERROR:\s+57014:/,
			'cancel: the refiller fails with 57014');
		$refiller->{s}->quit;
	}
	else
	{
		is(sql("SELECT pg_terminate_backend($refiller->{pid})"), 't',
			'terminate: the refiller is terminated');
		ok(backend_gone($node, $refiller->{pid}), 'terminate: the refiller is gone');
		$refiller->{s}{run}->kill_kill;
	}

	# The waiter refills itself (and stops at no pause point).
	my @tokens = claim_output($waiter);
	is(scalar(@tokens), 6, "$how: the waiter gets its 6 tokens");
	all_new($how, @tokens);
	cmp_ok(min(@tokens), '>', max(@seen), "$how: above every token seen before");
	push @seen, @tokens;
	$waiter->{s}->quit;
	$hold->quit;
}

# --- setval forward and back ----------------------------------------------------
my $far = max(@seen) + 1000000;
sql("SELECT setval('idempotency.token_seq', $far)");
my @forward = split /\n/,
  sql("SELECT token FROM idempotency.idem_claim_many(ARRAY['f1', 'f2', 'f3', "
	  . "'f4', 'f5', 'f6', 'f7', 'f8', 'f9', 'f10', 'f11', 'f12'], scope => 'setval') "
	  . "ORDER BY ord");
is(scalar(@forward), 12, 'setval forward: 12 tokens');
cmp_ok(min(@forward), '>', max(@seen), 'setval forward: tokens still increase');
is(join(',', grep { $forward[$_] <= $forward[ $_ - 1 ] } 1 .. $#forward), '',
	'setval forward: each token above the one before');
cmp_ok($forward[-1], '>', $far,
	'setval forward: once the block is refilled, tokens are above it');
cmp_ok(scalar(grep { $_ <= $far } @forward), '<=', 8,
	'setval forward: at most two blocks of tokens are drawn below it');
push @seen, @forward;

sql("SELECT setval('idempotency.token_seq', 1)");
my @back = split /\n/,
  sql("SELECT token FROM idempotency.idem_claim_many(ARRAY['b1', 'b2', 'b3', "
	  . "'b4', 'b5', 'b6', 'b7', 'b8', 'b9', 'b10'], scope => 'setval') ORDER BY ord");
is(scalar(@back), 10, 'setval back: 10 tokens');
cmp_ok(min(@back), '>', max(@seen), 'setval back: tokens do not go back');
all_new('setval back', @back);
cmp_ok(sql('SELECT last_value FROM idempotency.token_seq'), '>=', max(@back),
	'setval back: the refills moved the sequence forward again');
push @seen, @back;

# --- a new extension, a new database ------------------------------------------
drop_extension($node, 'postgres');
install_extension($node, 'postgres');
my @fresh = split /\n/,
  sql("SELECT token FROM idempotency.idem_claim_many(ARRAY['n1', 'n2', 'n3', "
	  . "'n4', 'n5', 'n6'], scope => 'recreated') ORDER BY ord");
is(join(',', @fresh), '1,2,3,4,5,6',
	'a new extension in the same database: tokens start from its new sequence');

$node->safe_psql('postgres', 'CREATE DATABASE other');
install_extension($node, 'other');
is( $node->safe_psql('other',
		"SELECT token FROM idempotency.idem_claim('o1', scope => 'other')"),
	'1', 'a new database: its tokens start from its own sequence');
my @next = split /\n/,
  sql("SELECT token FROM idempotency.idem_claim_many(ARRAY['n7', 'n8'], "
	  . "scope => 'recreated') ORDER BY ord");
is(join(',', @next), '7,8', 'the other database took nothing from this one');
$node->stop;

# --- without preloading: a sequence set back ------------------------------------
my $plain = new_node('plain', port => 55481, preload => 0,
	conf => ["idempotency.sweep_interval = 0"], extension => 1);
my $s1 = $plain->background_psql('postgres');
$s1->query_safe("SELECT token FROM idempotency.idem_claim('k1', scope => 'reused', "
	  . "session_bound => true)");
$plain->safe_psql('postgres',
	"SELECT setval('idempotency.token_seq', owner_session, false) "
	  . "FROM idempotency.keys WHERE scope = 'reused' AND key = 'k1'");
is( sqlstate_of($plain, 'postgres',
		"SELECT outcome FROM idempotency.idem_claim('k2', scope => 'reused', "
		  . "session_bound => true)"),
	'55000',
	'no preloading: a session handed a live session\'s binding again is refused (55000)');
is( $plain->safe_psql('postgres',
		"SELECT status || '|' || (owner_session IS NOT NULL) FROM idempotency.keys "
		  . "WHERE scope = 'reused' ORDER BY key"),
	'pending|true', 'no preloading: the live session keeps its key and binding');
$s1->quit;
$plain->stop;

done_testing();
