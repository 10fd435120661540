"""A held-out text corpus for the quality gate: 240 rows of text unlike examples/corpus.parquet's plain
everyday sentences, to measure the gate where a small ASR model (Whisper tiny.en) struggles.

The rows are invented quotations with attributions, dialogue in quotes, archaic English (thee,
whence, forsooth), Latin with bracketed translations, invented names and places of several
nationalities, numbers, years, money, ordinals, times and abbreviations, and asides in
parentheses, square or angle brackets that are meant to be read aloud. They were written for
cosybatch and copy no external source.

    python benchmarks/heldout_corpus.py   # writes benchmarks/data/heldout.jsonl
    python benchmarks/qc_detection.py --corpus benchmarks/data/heldout.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "heldout.jsonl"

ROWS = [
    # Invented quotations with attributions.
    "'Salt remembers the sea long after the sea forgets the salt,' wrote Ysolde Varnakis in 1718.",
    "'A ledger never lies, but its keeper often does,' observed Bartholomew Quennell-Ashby.",
    (
        "'Every bridge is a promise made to a stranger, and every toll a betrayal of it,' said Oluwaseun "
        "Adeyemi-Clarke at the opening of the Marrowfield span in 1897."
    ),
    "'Wherefore dost thou weep at harvest?' asked the old reeve of Thistlecombe.",
    "'The clock in Zell-am-Oberhof runs four minutes fast, and nobody minds,' noted Mrs. Hildegard Pfennigmacher.",
    "'Ink is cheaper than blood,' Dr. Cassius Oyelaran told the tribunal on the 3rd of March, 1851.",
    "'Whence cometh this fog?' muttered Brother Anselm, closing the scriptorium shutters.",
    "'I have counted the stars over Kazimierz twice, and lost my place both times,' confessed Jadwiga Szczepaniak.",
    "'Forsooth, the tide is no respecter of bishops,' quipped Sir Reginald Hawkspur.",
    "'Hunger is a poor cartographer,' wrote the explorer Tiberius Mbeki-Lindqvist in his 1763 journal.",
    "'One lamp in a window outshines a cathedral of darkness,' preached the Reverend Ezekiel Crumb.",
    "'The wise merchant sells umbrellas in July,' advised Fenwick Obuya, a trader of Mombasa.",
    "'Never argue with a lighthouse keeper about the weather,' warned Captain Ingrid Solvang-Mæhle.",
    "'A debt unpaid grows teeth,' said Grandmother Xiaoling Vantongeren at the 1924 family council.",
    "'Hither came the wolves, and thither went the sheep,' sang the shepherds of Glen Ardraich.",
    "'Mathematics is merely patience wearing spectacles,' Professor Leopold Zbigniewski remarked in 1909.",
    "'Thou shalt not pass the toll without thy three farthings,' declared the keeper of Pelworth Gate.",
    "'The quietest rooms hold the loudest secrets,' wrote Anneliese Drobnjak-Fairweather (1788–1841).",
    "'Grief is a tenant who never pays rent,' the poet Ifeoma Castellanos-Reyes wrote in 1956.",
    "'Bread first, sermons after,' insisted Mother Perpetua of the convent at San Ildefonso del Monte.",
    "'I regret nothing except the herring,' Lord Alistair Ponsonby-Vex declared on his eightieth birthday.",
    "'A map is a rumour with borders,' according to the geographer Rashida Okonkwo-Halvorsen.",
    "'Thrice I knocked, and thrice the door refused me,' lamented the minstrel Gervase of Lullingstone.",
    "'Fortune favours the well-fed,' said General Octavian Brisbane-Kowalczyk, eating his third breakfast.",
    (
        "'Do not trust a man who whistles in a library,' wrote Dame Philippa Nightingale-Oduya in 1832, in a "
        "letter to her nephew, who whistled constantly."
    ),
    "“Whither the river goes, so goes the town” was the motto of old Brackenmoor-upon-Wend.",
    "'Sixpence saved is a shilling dreamed,' Mr. Jeremiah Puddifoot liked to say.",
    "'The moon owes us nothing,' Tsvetana Bogdanova-Lund told her students in the winter of 1931.",
    "'Let the record show I objected, loudly and in Latin,' said Judge Horatio Vanderkloot.",
    "'Courage is only fear that has finished its tea,' wrote Euphemia Gallagher-Nwosu.",
    # Dialogue.
    "'Is the lantern lit?' asked Tobiah. 'Aye,' said Marguerite, 'but the oil is nearly gone.'",
    "'Hold the rope!' shouted Kwabena. 'Hold it, or we all go into the ravine!'",
    "'You again,' sighed the innkeeper. 'Room seven, and mind the stairs.'",
    '"Did you bring the papers?" "Only the forged ones," Ottoline replied.',
    "'Three ducats, not a penny less,' the pedlar insisted. 'Two,' said Radomir.",
    (
        "'Whence came this letter?' the magistrate demanded, holding it up to the lamp. 'From Vilnius, sir, "
        "by the night coach, and the seal was broken when it reached me.'"
    ),
    "'Shh,' hissed Perpetua. 'If the abbess hears us, we are done for.'",
    "'Forsooth, I did not steal the goose,' pleaded young Wystan. 'It followed me.'",
    "'Left at the chapel,' said the guide, 'then right at the hanging man's oak.'",
    "'Are we there yet?' 'No.' 'Now?' 'Still no, Benedikt.'",
    "'I will return by Michaelmas,' promised Sigrún. She did not return until the spring.",
    "'Is it poison?' asked Inspector Mbatha. 'Worse,' the chemist said. 'It is cheap sherry.'",
    "'Quickly — the candle!' cried Aurelio, as the draught swept through the crypt.",
    "'Tell no one,' murmured the countess. 'Not even the parrot.'",
    "'Who goes there?' 'A friend.' 'Friends knock, sir. You climbed the wall.'",
    "'Ten paces,' the second announced, 'then turn, and may God forgive you both.'",
    "'I have a plan,' said Nkechi. 'Is it a good plan?' 'It is a plan.'",
    "'Wherefore art thou so late, Ambrose?' 'The bridge at Kellsworth washed away, mother.'",
    "'Stand aside,' growled the bailiff. 'By order of the Court of Chancery, this mill is seized.'",
    '"Do you smell smoke?" asked Dr. Okafor. "Only your pipe, doctor," said the nurse.',
    (
        "'Row faster,' urged Thorvald, glancing back at the black cliffs of Hvalsnes. 'The tide turns at "
        "half past six, and after that nothing will carry us past the skerries.'"
    ),
    "'Say it again,' she demanded. 'Slowly, and in English this time.'",
    "'Mercy, mercy!' wailed the clerk. 'I only moved the decimal point once!'",
    "“Is this the road to Ploughkeep?” “It was, until the flood.”",
    "'Come hither, child,' said the crone, 'and tell me what the ravens told thee.'",
    "'We sail at dawn,' said Admiral Castellane. 'Whether the wind agrees or not.'",
    "'One more word,' warned Mrs. Abernathy-Quist, 'and you shall dine in the coal cellar.'",
    "'Where is the key?' 'In the teapot.' 'Why in heaven's name is it in the teapot?'",
    "'Ready?' 'Ready.' 'On my count, then — one, two, three!'",
    "'Rain again,' said Bertram glumly.",
    # Archaic English.
    "Hither and thither ran the squire, seeking his lost gauntlet among the hay bales.",
    "Whence the stranger came, no soul in Aldermere could say.",
    "Prithee, good sir, lend me thy horse until the morrow.",
    "Wherefore the king hath summoned us, none shall know until vespers.",
    "Thou art a knave, and thy cousin is a worse one.",
    "Methinks the miller hath watered his flour again.",
    "Forsooth, the ale at the Crooked Lamprey is thinner than rain.",
    "Ere the cock crows thrice, thou shalt hear the bells of Saint Wilfreda.",
    "Hark! The heralds approach from yonder hill, bearing the banner of Gwynedd-Ravensholt.",
    "Anon the players arrived, their wagon creaking beneath painted canvas and tin crowns.",
    "Verily, I say unto thee, the pudding was burnt.",
    "Whither goest thou, pilgrim, with naught but a staff and a turnip?",
    "She bade him tarry a while, yet he would not.",
    "Gramercy, mistress, for the loaf and the lodging.",
    "Thence they journeyed north, through Mirrendale and the marshes of Quoyness.",
    "Alack, the goose hath flown, and with it my supper.",
    (
        "Wilt thou swear upon the relics of Saint Oswy that thou wast not at the fair in Dunholt, or must I "
        "fetch the bailiff and his dogs?"
    ),
    "Betwixt the abbey and the alehouse lay a furlong of mud.",
    "The reeve doth reckon the tithes by candlelight, muttering sums beneath his breath.",
    "Hie thee to the apothecary, and bring back wormwood, not wolfsbane.",
    "Fain would I stay, but the tolling of the curfew bell calls me hence.",
    "Oft have I wondered whither the swallows fly in winter.",
    "Quoth the sexton, 'Dig deeper, lads, the ground is hungry this year.'",
    "Wherefore dost thou tarry?",
    "Whilst the baron slept, his steward sold the orchard.",
    "Sirrah, unhand that capon!",
    "Peradventure the rain shall cease by Lammastide.",
    "Yea, and the well at Cleeve Hollow ran dry that very summer.",
    "Nay, thou shalt not have the last of the mead.",
    # Latin with translations.
    "Festina lente [make haste slowly], muttered Captain Ruiz-Halloran as the crew rushed the sails.",
    "Carpe noctem [seize the night], the students chanted beneath the provost's window.",
    "Above the gate of Hollowmere Abbey was carved: Ora et labora [pray and work].",
    "'Alea iacta est [the die is cast],' said Severina, and pushed every coin to the centre.",
    "Dum spiro, spero [while I breathe, I hope] was stitched on the sampler above her bed.",
    "The motto of the Guild of Chandlers was Lux in tenebris (light in darkness).",
    "'Quis custodiet ipsos custodes [who will guard the guards themselves]?' asked the anxious alderman.",
    (
        "Per aspera ad astra [through hardships to the stars], read the brass plaque at the observatory on "
        "Kellagh Fell, which had not seen a clear sky since 1896."
    ),
    "In vino veritas (in wine, truth), the vicar declared, refilling his glass for the fourth time.",
    "Tempus fugit [time flies], and so, apparently, does the ferry to Inishcarrow.",
    "Memento mori [remember that you must die] was painted beneath the skull in the chapel at Orsolya.",
    "The treaty was adjourned sine die [without a day fixed for resuming], to everyone's dismay.",
    "'Mea culpa [my fault],' admitted the cook, gazing at the ruined soufflé.",
    "Amor vincit omnia (love conquers all), though not, it seems, the landlady of Number 14.",
    "Nil desperandum [never despair], Dr. Pennington-Ruiz told his patients every Thursday.",
    "The family crest bore the words Fortis et fidelis [strong and faithful] beneath a rampant hare.",
    "Caveat emptor [let the buyer beware], the auctioneer reminded the room before lot 212.",
    "'Ad nauseam [to the point of sickness],' grumbled Professor Ostrowska, 'he repeats the same lecture.'",
    "Semper paratus [always ready], the lifeboat crew of Porthkennack answered when the maroons sounded.",
    "Terra incognita [unknown land] was all the cartographer wrote across the northern half of the map.",
    "Pro bono publico (for the public good), the lawyer said, waiving his fee of forty guineas.",
    "Ex nihilo nihil fit [nothing comes from nothing], the alchemist sighed over his empty crucible.",
    "Deo volente [God willing], the harvest will be in by the 29th of September.",
    "Ipso facto [by that very fact], the contract was void, said Mr. Thistlewood of Cobb's Inn.",
    "Requiescat in pace [may she rest in peace], Magdalena Kowalewska-Brandt, 1803 to 1879.",
    "Vox clamantis [a voice crying out], the editor called his weekly column.",
    "The students of St. Brendan's College sang Gaudeamus igitur [let us therefore rejoice] at every feast.",
    "Quod erat demonstrandum [which was to be demonstrated], Ilse wrote, and set down her chalk.",
    "Bona fide (in good faith), the merchant swore, though his scales were plainly crooked.",
    "Status quo ante bellum [the state before the war] was restored at Vierzenfeld in 1714.",
    "Non sequitur [it does not follow], objected the examiner, crossing out the entire paragraph.",
    # Numbers, dates, money, times and abbreviations.
    "The coach left Bath at 4:15 p.m. and reached St. Albans shortly after midnight.",
    "Mr. Quimby paid $3.50 for the map and 75 cents for the candle.",
    "On the 19th of May, 1873, the Royal Oak Inn at Fennick burned to the ground.",
    "Dr. Ngozi Abernethy-Lowe arrives on Platform 9 at 11:42 a.m. sharp.",
    "The 3rd Battalion marched 27 miles in a single day, losing only 2 mules.",
    "He owed £1,240 to the bank and another £85 to his tailor on Marrow St.",
    "Lot 47, a Flemish clock of 1681, sold for 18,500 guilders after fierce bidding.",
    "The 1st, 2nd and 3rd prizes went to Mrs. Oyelowo, Mr. Tanaka-Briggs and Dr. Fenn.",
    "At 6:05 a.m. on the 2nd of January the thermometer read minus 31 degrees.",
    (
        "Between 1790 and 1815, the population of Port Caddaran fell from 4,200 to 1,760, because of the "
        "herring failure of 1802 and the press gangs of the 4th Regiment."
    ),
    "The ledger shows 3 barrels of pitch at 14 shillings each, and 1 anchor at £9.",
    "No. 63 St. Ignatius Lane was let to a Mr. Vossberg for 12 guineas a year.",
    "The train from Krakow was delayed by 47 minutes, arriving at 10:27 p.m.",
    "Her 100th birthday fell on the 29th of February, 2000, to the delight of the newspapers.",
    "Capt. Hollis Mabry-Ndiaye logged 3,412 nautical miles in 41 days.",
    (
        "Tickets to the Grand Menagerie at Pollard's Green cost $12.75 for adults, $6.25 for children over "
        "5, and nothing at all for dogs on leads."
    ),
    "The 14th-century bell weighs 2,730 kilograms and rings in the key of E flat.",
    "Prof. Zhivkova lectured from 9:30 to 11:00 every Tuesday for 26 years.",
    "The 1911 census lists 7 lodgers at 18 Gullet Row, all of them fishmongers.",
    "Sgt. Odhiambo counted 1,018 sheep, then 1,019, then gave up entirely.",
    "The will left 500 acres to the eldest son and 2 pence to the youngest.",
    "Gen. Ferreira-Lindholm surrendered at 3:20 p.m. on the 8th of August, 1759.",
    "The 6:48 to Little Dunmarsh was cancelled for the 9th time that month.",
    "A quart of cider cost 4 pence in 1820 and 9 pence by 1860.",
    "Mt. Kessarine rises 4,881 metres above the valley of Dulwen.",
    "Flight 607 to Reykjavik boards at Gate 23 at 7:55 a.m.",
    "P.C. Petrakis earned 38 shillings a week and a new helmet every 3 years.",
    "In 1666 the vestry spent 17 shillings and 6 pence on a new bell rope.",
    "The bill came to $84.60, and Mrs. Delacroix-Mbeki left a tip of exactly 40 cents.",
    "Room 1207 of the Grand Hotel Vorhaven was booked from the 3rd to the 17th of June.",
    "By 1:30 a.m. the snow was 2 feet deep on Market St. and still falling.",
    "He was born on the 31st of December 1899 and so, he claimed, belonged to no century.",
    "At precisely 12:01 a.m. on New Year's Day, 1900, the Lord Mayor of Tumbridge sneezed.",
    "The 4th Earl of Kilmarrow owned 3 castles, 11 hounds and 1 pair of boots.",
    # Asides and bracketed text that is read aloud.
    "The bishop (as he later admitted) had never read the letter at all.",
    "Uncle Ptolemy (a man of firm opinions) refused to ride in anything with wheels.",
    (
        "The recipe, copied out by Great-Aunt Dorotea in 1907, calls for saffron (or, failing that, turmeric "
        "and a good deal of hope) and a copper pan."
    ),
    "Miss Oyinlola Hartwell-Sandoval (née Adebayo) inherited the mill in 1888.",
    "The expedition reached Tsarevka Pass (elevation 3,100 metres) on the 6th of October.",
    "The witness claimed (under oath, no less) that the horse had spoken to him.",
    "Our guide, Mr. Ruslan Baktygulov (formerly of the Imperial Survey), knew every goat track by heart.",
    "The letter was signed <illegible>, and sealed with green wax.",
    (
        "The telegram from Aunt Hortensia read, in full: <Arrive Tuesday 4:40 train stop bring umbrella and "
        "the good teapot stop do not tell Harold stop>."
    ),
    "Beneath the portrait, a small card read <Lady Cressida Vane, 1762, artist unknown>.",
    "The notice on the door said [closed for the funeral of the cat].",
    "The stage direction reads [enter the baker, carrying an enormous eel].",
    "Her reply was short [she never wrote long replies] but kindly meant.",
    "The ship's log for that night says only [fog, fog, and more fog].",
    "The recording begins [sound of rain], then a man's voice says 'Again.'",
    "The minutes record that the chairman [Mr. Obadiah Fitch] fell asleep twice.",
    "Aunt Wilhelmina (who disliked all poetry) recited the entire ballad from memory.",
    "The bridge (completed in 1834, rebuilt in 1902) still carries the mail coach road.",
    "The prize (a silver ladle and 20 guineas) went to the widow Marchbanks.",
    (
        "The manuscript breaks off mid-sentence [here the page is torn away and stained with what may be "
        "candle wax] and resumes, several pages later, in another hand."
    ),
    "He signed the register as 'Count Zoltan Vasarhelyi' (his real name was Tom Briggs).",
    "The label on the bottle said <not for internal use>, which the sailors ignored.",
    "Professor Amundsen-Okoro (then only twenty-six) disproved the theorem in a single afternoon.",
    "The town crier announced [by order of the mayor] that pigs were banned from the square.",
    "We left Ambleford (in the rain, naturally) at a quarter past eight.",
    "The second verse [sung more slowly] tells of the drowned village beneath the reservoir.",
    "The painting (if one can call it that) hung in the vestibule for forty years.",
    "The sign above the shop read <Pickering and Daughters, Hatters since 1791>.",
    "His diary entry for the 4th of July [written in pencil] reads: 'Nothing happened. Good.'",
    # Unusual names and places.
    "Xanthippe Oyelaran-Muir and her brother Caradoc sailed from Tromsø in the spring of 1849.",
    "The market at Qarshi-Vellandra sells figs, brass lamps and very old parrots.",
    "Bartholomew Nwachukwu-Fitzgerald was the only cartographer ever banned from Lisbon.",
    (
        "Siobhán Ní Dhuibhir taught mathematics at the convent school in Ballykinvarra from 1931 until 1968, "
        "and not one of her pupils ever forgot the seven times table."
    ),
    "Wojciech Przybylski-Hartmann repaired clocks on Ulica Szeroka for fifty years.",
    "The sisters Ekaterina and Oksana Dvoryashina ran the only bakery in Nizhny Zavolzhsk.",
    "Thaddeus Quarrington-Blythe proposed to Amaranta Villalobos on the steps of the Teatro Solano.",
    "Nobody in Llanfair Gwythian could pronounce the new vicar's name, Mr. Tchaikovitch-Evans.",
    "Guðrún Hallvarðsdóttir kept the lighthouse on Skerjavík for thirty-one winters.",
    "Kofi Asante-Ravensworth walked from Kumasi to the coast to deliver one letter.",
    "The duel between Lorcan Mac Giolla Phádraig and Ferdinand von Ebersbach-Trolle never took place.",
    "Ignatius Okonjo and Pernille Ravnkilde opened a tearoom in Østerby in 1922.",
    (
        "In the autumn of 1874 the caravan stopped at Tash-Kumyr, then at Yerbolat, then at a nameless well, "
        "before the first snows closed the Kessim Pass."
    ),
    "Isambard Kwarteng-Featherstonehaugh designed the viaduct at Crickhollow Vale.",
    "Mademoiselle Éloïse Duvernay-Marchetti played the harpsichord badly, but with conviction.",
    "Fyodor Ignatyevich Bryukhanov was the ferryman at Staraya Mologa for twenty years.",
    "In the village of Heddlesthwaite, the postmistress Ottilie Grimsdyke knew everyone's business.",
    "Achterberg, Vlieland-Kroon and Oudejans founded the shipping firm in Zeerijp in 1768.",
    "Tamsin Trevorrow and Jago Penhallurick were married in the chapel at Polgwidden Cove.",
    "The caliph's vizier, Abu Tahir al-Zarnuji, kept seventeen cats and one melancholy camel.",
    "Mrs. Chidimma Okafor-Lindqvist was elected mayor of Skelbeck Bridge by four votes.",
    "Haruto Kanzaki-Morrow drew the first map of the Ombrelune archipelago.",
    "Dagfinn Sørumsand and Eulalia Quispe met at the observatory in Villa Paxamarca.",
    "Baron Casimir Wrzesniewski lost his estate at cards to a bishop from Lviv.",
    "Old Mother Gwenllian Prydderch sold herbs at the fair in Llanddewi Fach.",
    "Pieter-Jan Vanderhaeghen and Ottavio Squarcialupi argued over the bill until dawn.",
    "Zephaniah Mbugua-Pemberton was the first man to cross the Sarnath Flats by bicycle.",
    "The smugglers of Dunscraig Bay answered only to a woman called Morwenna Skelhorne.",
    "Rosalind Achebe-Vandermeer catalogued 1,400 species of beetle in the Kovalenko Forest.",
    # Literary oddities, dashes and short lines.
    "The ferry — late, as always — groaned against the pilings at Saltmarsh Quay.",
    "She opened the casket, and there — wrapped in oilcloth — lay the missing deed.",
    "Lanterns, lanterns everywhere, and not a single match.",
    "The orchestra tuned, coughed, tuned again, and finally began the overture to Il Barbiere di Castelnuovo.",
    "Somewhere beyond the marsh, a bittern boomed — three times, then silence.",
    "The archivist sneezed; a century of dust rose like smoke from the Hapsgrove papers.",
    "Nobody remembers why the bells of Saint Cuthwen ring at 3:33 every afternoon.",
    "The old cartwright's hands — gnarled, stained, steady — shaped the felloe in a single afternoon.",
    "Beware the eel-wives of Mardle Fen.",
    "Seventeen lanterns hung from the rafters of the tithe barn.",
    (
        "In the old manner of the Dalmorran clans, the oath was sworn upon a broken sword, a loaf of rye "
        "bread, a jar of honey and a live hen."
    ),
    "It was, by common consent, the worst harvest festival in the history of Upper Snoddington.",
    "What the tinker sold was not a kettle — it was the promise of a kettle.",
    "The semaphore tower at Craigmhor flashed its message across the firth: all is lost, send biscuits.",
    "They buried the time capsule beneath the bandstand, with strict instructions not to open it before 2076.",
    "A heron stood motionless in the millrace, as if it had been hired to do so.",
    "Quietly, quietly, the cellar door swung open.",
    "The chandelier swayed; the dowager did not.",
    "Of the nine pilgrims who set out from Compostrella, only four ever reached the shrine.",
    "The apothecary's jars bore labels in three languages: Latin, Flemish and something nobody could identify.",
    (
        "Before he settled in Pennwick at the age of sixty, he had been a soldier, a smuggler, a curate and "
        "— briefly — a tightrope walker."
    ),
    "All night the gale tore at the slates of the customs house in Kirkwaddock.",
    "The glassblower's apprentice dropped the vase; the glassblower, to everyone's surprise, laughed.",
    "The final entry in the almanac predicted rain, frogs and a minor earthquake.",
    "Under the third flagstone from the altar, the sexton found a tin box of farthings.",
    "By the time the magistrate arrived, the accused, the evidence and the magistrate's own horse had all vanished.",
    "The hurdy-gurdy man of Zollbrücken played the same three tunes for forty years, and was beloved for it.",
    "Mist rolled in from the northern sea and swallowed the harbour of Varrowick whole.",
]


def main() -> None:
    rows = list(ROWS)
    random.Random(0).shuffle(rows)  # mix the kinds of text, so no stretch of the run is all of one kind
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", encoding="utf-8") as f:
        for i, text in enumerate(rows):
            f.write(json.dumps({"id": f"ho-{i:04d}", "text": text}, ensure_ascii=False) + "\n")
    print(f"{len(rows)} rows -> {OUT}")


if __name__ == "__main__":
    main()
